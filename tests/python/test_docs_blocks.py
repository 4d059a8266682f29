"""The integration docs run as written: the fenced ```python blocks of
docs/LIGHTNING.md, HF.md, ACCELERATE.md and EXACT_RESUME.md are extracted
and executed, each doc in a fresh subprocess in a temporary directory,
under a hard timeout.

The convention (for whoever writes or merges these docs):

- By default a doc's python blocks are joined in order into one script (as
  a reader pastes them one after the other: a later block may use an
  earlier one's imports and names) and that script runs twice in the same
  directory: the second run resumes from the first one's checkpoints, so a
  resume example must work both ways. Blocks indented inside a list item
  count too (their indentation is removed).
- An HTML comment on the line right before the opening fence changes that
  for its block only:
  - `<!-- nonstop-doc: skip (REASON) -->`: not run; the reason is
    required (keep these rare: a fragment should rather be made runnable);
  - `<!-- nonstop-doc: torchrun N -->`: the block alone is a complete
    script, run once in its own directory with
    `python -m torch.distributed.run --standalone --nproc_per_node N`
    (CPU, gloo), once (a restart under torchrun is what test_hf_dist.py
    and test_distributed.py test; once keeps this file fast).
- Blocks in other languages (```bash, ```text, bare ```) are not run.
- Keep examples small and CPU-only: this whole file should stay well under
  two minutes.
"""
import os
import re
import subprocess
import sys
import textwrap

import pytest

import nonstop
from conftest import needs_engine
from nonstop.lightning import read_marker

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = ["LIGHTNING.md", "HF.md", "ACCELERATE.md", "EXACT_RESUME.md"]
TIMEOUT = 120  # seconds, per run
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
       "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}

pytestmark = needs_engine

FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[^\s`]*)[ \t]*$")
MARK = re.compile(r"^\s*<!--\s*nonstop-doc:\s*(?P<what>.*?)\s*-->\s*$")


def blocks(text: str) -> list:
    """[(directive or None, code)] of the ```python blocks of `text`; the
    directive is the nonstop-doc comment on the line before the fence."""
    lines = text.splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and not (FENCE.match(lines[j]) and
                                      FENCE.match(lines[j]).group("lang") == ""):
            j += 1
        if m.group("lang") == "python":
            prev = MARK.match(lines[i - 1]) if i > 0 else None
            code = textwrap.dedent("\n".join(lines[i + 1:j])) + "\n"
            out.append((prev.group("what") if prev else None, code))
        i = j + 1
    return out


def plan(doc: str) -> tuple:
    """(the joined default script, [(N, script) to run under torchrun]);
    an unknown directive or a skip without a reason fails."""
    with open(os.path.join(ROOT, "docs", doc)) as f:
        found = blocks(f.read())
    assert found, f"docs/{doc} has no python block"
    joined, launched = [], []
    for what, code in found:
        if what is None:
            joined.append(code)
        elif re.fullmatch(r"skip \(.+\)", what):
            continue
        elif re.fullmatch(r"torchrun \d+", what):
            launched.append((int(what.split()[1]), code))
        else:
            raise AssertionError(f"docs/{doc}: unknown nonstop-doc directive {what!r} "
                                 f"(skip (REASON) or torchrun N)")
    return "\n".join(joined), launched


def run(cmd, cwd, doc, what):
    env = {**os.environ, **ENV}
    try:
        r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT,
                           env=env, start_new_session=True)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"docs/{doc} {what}: no end in {TIMEOUT} s") from e
    assert r.returncode == 0, f"docs/{doc} {what} exited {r.returncode}:\n{r.stderr[-3000:]}"


def lightning_resumed_at_the_end(d):
    m = read_marker(str(d / "runs/lightning/last.ckpt"))
    assert m["step"] == 19
    assert nonstop.load(str(d / "runs/lightning/nonstop")).step == 19


def hf_resumed_through_the_bridge(d):
    assert nonstop.load(str(d / "runs/hf/nonstop")).step == 11
    # the second run resumed through the bridge folder, whose full copy of the
    # weights is gone once the Trainer loaded it (the folder too, once its
    # first step began)
    assert not (d / "runs/hf/nonstop-resume/checkpoint-12/model.safetensors").exists()
    assert (d / "runs/hf/nonstop-resume").is_dir()


def accelerate_ran_to_the_end(d):
    assert nonstop.load(str(d / "runs/accelerate")).step == 19


# What each doc's two runs must have left behind (the end of training, and
# the resume path the doc describes), beyond exiting 0.
AFTER = {"LIGHTNING.md": lightning_resumed_at_the_end, "HF.md": hf_resumed_through_the_bridge,
         "ACCELERATE.md": accelerate_ran_to_the_end}


@pytest.mark.parametrize("doc", DOCS)
def test_doc_blocks_run_as_written(doc, tmp_path):
    script, launched = plan(doc)
    if script.strip():
        path = tmp_path / "doc.py"
        path.write_text(script)
        for n in (1, 2):  # the second run resumes from the first one's checkpoints
            run([sys.executable, str(path)], str(tmp_path), doc, f"blocks (run {n})")
        if doc in AFTER:
            AFTER[doc](tmp_path)
    for k, (nproc, code) in enumerate(launched):
        d = tmp_path / f"torchrun-{k}"
        d.mkdir()
        (d / "doc.py").write_text(code)
        run([sys.executable, "-m", "torch.distributed.run", "--standalone",
             f"--nproc_per_node={nproc}", "doc.py"], str(d), doc, f"torchrun block {k}")


def test_the_convention_is_parsed():
    text = textwrap.dedent("""\
        ```python
        a = 1
        ```
        - item

          ```python
          b = a
          ```
        <!-- nonstop-doc: skip (a fragment) -->
        ```python
        undefined_name
        ```
        <!-- nonstop-doc: torchrun 2 -->
        ```python
        c = 3
        ```
        ```bash
        echo no
        ```
        """)
    assert blocks(text) == [(None, "a = 1\n"), (None, "b = a\n"),
                            ("skip (a fragment)", "undefined_name\n"), ("torchrun 2", "c = 3\n")]
