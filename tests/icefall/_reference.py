"""icefall's own Zipformer recipe code (the PyPI package ``zipformer``) with its training-only
imports faked; shared by the icefall tests and the benchmark."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
import types
from collections.abc import Iterator


def _module(name: str, package: bool = False, **attrs) -> types.ModuleType:
    m = types.ModuleType(name)
    if package:
        m.__path__ = []
    m.__dict__.update(attrs)
    return m


def _classes(*names: str) -> dict[str, type]:
    return {n: type(n, (), {}) for n in names}


@contextlib.contextmanager
def icefall_reference(compile_activations: bool = False) -> Iterator[types.SimpleNamespace]:
    """Yields ``model`` (zipformer.modules.model), ``search`` (zipformer.decode.search) and
    ``zipformer`` (zipformer.modules.zipformer) imported from the installed package, with its
    training-only dependencies (atdataset, kaldialign, the ngram LM, tensorboard ...) replaced by
    small fakes in ``sys.modules``; everything is restored afterwards. ``torch.compile`` of the
    Swoosh activations is turned off (the package's own ``K2_ONNX_EXPORT`` switch) so the
    reference runs eagerly, unless ``compile_activations`` (the package's default, for the
    benchmark)."""
    spec = importlib.util.find_spec("zipformer")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the icefall reference is missing: pip install --no-deps zipformer==0.1.3")
    pkg_dir = list(spec.submodule_search_locations)[0]
    names = ("zipformer", "atdataset", "kaldialign")
    saved = {k: v for k, v in sys.modules.items() if k.split(".")[0] in names}
    old_env = os.environ.get("K2_ONNX_EXPORT")
    os.environ["K2_ONNX_EXPORT"] = "0" if compile_activations else "1"
    for name in saved:
        del sys.modules[name]
    root = _module("zipformer", package=True)
    root.__path__ = [pkg_dir]
    root.__spec__ = spec  # other fixtures look the package up (importlib.util.find_spec)
    fakes = {
        "zipformer": root,
        "atdataset": _module("atdataset", SpecAugment=type("SpecAugment", (), {}),
                             time_warp=lambda *a, **k: None, fix_random_seed=lambda *a: None),
        "kaldialign": _module("kaldialign", align=lambda *a, **k: []),
        "zipformer.decode.ngram_lm": _module("zipformer.decode.ngram_lm",
                                             **_classes("NgramLm", "NgramLmStateCost")),
    }
    sys.modules.update(fakes)
    try:
        # the real helpers (make_pad_mask, stack_states, ...) without zipformer.utils' __init__,
        # which pulls in checkpointing, logging and distributed training
        uspec = importlib.util.spec_from_file_location(
            "zipformer.utils.utils", os.path.join(pkg_dir, "utils", "utils.py"))
        umod = importlib.util.module_from_spec(uspec)
        sys.modules["zipformer.utils.utils"] = umod
        uspec.loader.exec_module(umod)
        utils = _module("zipformer.utils", package=True)
        utils.__dict__.update({k: v for k, v in vars(umod).items() if not k.startswith("__")})
        sys.modules["zipformer.utils"] = utils
        yield types.SimpleNamespace(
            model=importlib.import_module("zipformer.modules.model"),
            zipformer=importlib.import_module("zipformer.modules.zipformer"),
            search=importlib.import_module("zipformer.decode.search"),
            utils=umod,
        )
    finally:
        for name in [k for k in sys.modules if k.split(".")[0] in names]:
            del sys.modules[name]
        sys.modules.update(saved)
        if old_env is None:
            os.environ.pop("K2_ONNX_EXPORT", None)
        else:
            os.environ["K2_ONNX_EXPORT"] = old_env
