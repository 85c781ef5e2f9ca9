"""Every relative link in the docs and every repository path they name in code spans exists."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAGES = sorted((REPO / "docs").glob("*.md")) + [
    REPO / name
    for name in (
        "README.md",
        "SECURITY.md",
        "CONTRIBUTING.md",
        "deploy/README.md",
        "examples/web/README.md",
    )
]
#: The seed's documentation set: each page exists and the docs index links it.
SEED_PAGES = (
    "architecture.md",
    "engine.md",
    "faq.md",
    "checkpoints.md",
    "tokenizers.md",
    "cache_manager.md",
    "kernels.md",
    "quantization.md",
    "ctc_decoder_gpu.md",
    "wfst_decoder_gpu.md",
    "autotuning.md",
    "ci.md",
)
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_CODE = re.compile(r"`([^`\n]+)`")
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
#: A code span is a repository path when it has a slash and starts at one of these (top-level
#: directories, or a package name that lives under some distribution's ``src/``).
_TOP = {p.name for p in REPO.iterdir() if not p.name.startswith(".")}
_SUFFIX = re.compile(r"\.(py|md|sh|toml|json|yml|yaml|proto|cu|txt|jsonl|html|js|css)$")


def _packages() -> dict[str, list[Path]]:
    found: dict[str, list[Path]] = {}
    for src in [*REPO.glob("*/src"), *REPO.glob("examples/*/src")]:
        for pkg in src.iterdir():
            if pkg.is_dir() and not pkg.name.endswith(".egg-info"):
                found.setdefault(pkg.name, []).append(src)
    return found


PACKAGES = _packages()


def _links(text: str) -> list[str]:
    return _LINK.findall(_FENCE.sub("", text))


def _code_paths(text: str) -> list[str]:
    """Code spans that name a file or directory of the repository."""
    out = []
    for span in _CODE.findall(_FENCE.sub("", text)):
        span = span.strip().rstrip(".,:;")
        if " " in span or "/" not in span or "*" in span or "{" in span or "<" in span:
            continue
        if span.startswith(("http", "/", "~", "$", "-", ".")):
            continue
        head = span.split("/", 1)[0]
        if head in _TOP or head in PACKAGES:
            if _SUFFIX.search(span) or span.endswith("/"):
                out.append(span)
    return out


def _exists(span: str) -> bool:
    path = span.split("::")[0].split(":")[0]
    if (REPO / path).exists():
        return True
    head = path.split("/", 1)[0]
    return any((src / path).exists() for src in PACKAGES.get(head, []))


def test_every_relative_link_resolves() -> None:
    broken = []
    for page in PAGES:
        for target in _links(page.read_text()):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # http(s), mailto: and in-page anchors
            path = target.split("#", 1)[0]
            if path and not (page.parent / path).exists():
                broken.append(f"{page.relative_to(REPO)}: {target}")
    assert broken == [], "links to nothing:\n" + "\n".join(broken)


def test_every_code_path_named_in_the_docs_exists() -> None:
    missing, named = [], 0
    for page in PAGES:
        for span in _code_paths(page.read_text()):
            named += 1
            if not _exists(span):
                missing.append(f"{page.relative_to(REPO)}: {span}")
    assert named > 50  # the check sees the docs' paths at all
    assert missing == [], "paths that do not exist:\n" + "\n".join(missing)


def test_the_checks_catch_a_broken_link_and_path() -> None:
    text = (
        "see [x](no_such_page.md) and `oasr-core/src/oasr/no_such_module.py` and `oasr/engine.py`"
    )
    assert _links(text) == ["no_such_page.md"]
    spans = _code_paths(text)
    assert spans == ["oasr-core/src/oasr/no_such_module.py", "oasr/engine.py"]
    assert [_exists(s) for s in spans] == [False, True]


def test_the_seed_pages_exist_and_the_index_links_them() -> None:
    index = (REPO / "docs" / "README.md").read_text()
    linked = set(_links(index))
    for name in SEED_PAGES:
        assert (REPO / "docs" / name).is_file(), name
        assert name in linked, f"docs/README.md does not link {name}"
    for page in sorted((REPO / "docs").glob("*.md")):
        if page.name != "README.md":
            assert page.name in linked, f"docs/README.md does not link {page.name}"
