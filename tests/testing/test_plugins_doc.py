"""The Profiler section of docs/plugins.md runs as written, given a harness of its own."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

from kareus.model import OutsideWork

PAGE = Path(__file__).resolve().parents[2] / "docs" / "plugins.md"


def _section(title: str) -> str:
    text = PAGE.read_text(encoding="utf-8")
    start = text.index(f"## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else None]


def _harness() -> SimpleNamespace:
    """What the page calls ``my_harness``: times that fall with the clock, energy at 400 W."""

    def run(partition, config):  # type: ignore[no-untyped-def]
        t = 1e-3 * (1.0 + 1000.0 / config.freq_mhz)
        return t, 400.0 * t * partition.group_gpus

    def run_outside(work, freq_mhz, comm_sms):  # type: ignore[no-untyped-def]
        assert isinstance(work, OutsideWork)  # what the page says `work` is
        t = 1e-4 * (1 + len(work.ops)) * (1.0 + 1000.0 / freq_mhz)
        return t, 400.0 * t

    return SimpleNamespace(run=run, run_outside=run_outside)


def test_the_profiler_snippets_run_and_pass_the_conformance_suite():
    blocks = re.findall(r"```python\n(.*?)```", _section("A Profiler"), flags=re.S)
    assert len(blocks) == 2
    scope: dict[str, object] = {"my_harness": _harness(), "__name__": "plugins_doc"}
    for block in blocks:  # the second runs check_profiler: it raises if the profiler fails
        exec(compile(block, str(PAGE), "exec"), scope)
    assert scope["my_partition"].name == "fwd_attn"  # type: ignore[attr-defined]
