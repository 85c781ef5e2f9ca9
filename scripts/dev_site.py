"""Expose this repository's distributions as installed ones without pip or a build backend.

For machines that cannot build or download (the GPU box): writes a ``*.dist-info`` folder with
``METADATA``, ``entry_points.txt`` and a ``.pth`` pointing at each ``src`` tree into SITE, so
``importlib.metadata`` finds the ``oasr`` entry points exactly as after ``pip install -e``.

    python3 scripts/dev_site.py /tmp/site && export PYTHONPATH=/tmp/site
"""

from __future__ import annotations

import sys
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[1]
DISTRIBUTIONS = [
    "oasr-core", "oasr-models-whisper", "oasr-models-wenet", "oasr-models-icefall",
    "oasr-models-nemo", "oasr-models-funasr", "oasr-models-qwen", "oasr-vad-silero", "oasr-kernels",
    "oasr-server", "oasr-decoders-wfst",
]  # fmt: skip


def main(site: Path) -> None:
    site.mkdir(parents=True, exist_ok=True)
    paths = []
    for folder in DISTRIBUTIONS:
        project = tomllib.loads((REPO / folder / "pyproject.toml").read_text())["project"]
        name, version = project["name"], project["version"]
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir(exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        groups = project.get("entry-points", {})
        scripts = project.get("scripts", {})
        text = "".join(
            f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items())
            for group, eps in {**groups, **({"console_scripts": scripts} if scripts else {})}.items()
        )
        (info / "entry_points.txt").write_text(text)
        paths.append(str(REPO / folder / "src"))
    # site is on PYTHONPATH, not a site dir, so .pth files are not read: print the src paths.
    print(":".join([str(site), *paths]))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
