"""`import oasr` and `oasr --help` must not import torch (startup speed)."""

from __future__ import annotations

import subprocess
import sys

CHECK = "import sys; {body}; print('torch' in sys.modules, 'numpy' in sys.modules)"


def _run(body: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", CHECK.format(body=body)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()[-1]


def test_import_oasr_does_not_import_torch() -> None:
    assert _run("import oasr; oasr.__version__; oasr.DecodingOptions") == "False False"


def test_cli_help_and_listings_do_not_import_torch() -> None:
    for args in (["--help"], ["--version"], ["models", "--json"], ["plugins", "--json"]):
        body = (
            "from oasr.cli.main import main\n"
            f"try:\n    main({args!r})\nexcept SystemExit as e:\n    assert not e.code, e.code"
        )
        result = _run(f"exec({body!r})")
        assert result.startswith("False"), (args, result)


def test_version_matches_package() -> None:
    from importlib.metadata import version

    import oasr

    assert oasr.__version__ == version("oasr-core")
