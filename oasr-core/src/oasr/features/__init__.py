"""Feature frontends, registered on the ``feature_extractor`` axis by ``FeatureSpec.kind``."""
