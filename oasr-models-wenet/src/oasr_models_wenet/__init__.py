"""WeNet Conformer U2/U2++ for OASR. Heavy modules (torch) load only when a spec is resolved."""

__all__: list[str] = []
