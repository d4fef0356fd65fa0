"""`export --hf` writes a whole folder or nothing, with readable files, a tokenizer that pads (the README's example runs
as written), and the package's own model code, which transformers loads with trust_remote_code=True where
hybrid_attention is not installed."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import re
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

from hybrid_attention import cli  # noqa: E402
from hybrid_attention.hf import export  # noqa: E402
from hybrid_attention.inference.generate import generate  # noqa: E402
from hybrid_attention.runs.checkpoint import load_run  # noqa: E402
from tests.helpers import REPO_ROOT, rel_err, run_cli  # noqa: E402

pytestmark = pytest.mark.usefixtures("quiet_transformers")

ARGS = ["--steps", 2, "--batch-size", 2, "--seq-len", 16, "--eval-batches", 1]

# A process where hybrid_attention cannot be imported: no PYTHONPATH, and the editable install's finder left out.
HIDDEN = """
import importlib.util, sys
from pathlib import Path
sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
sys.path[:] = [p for p in sys.path if not Path(p or ".", "hybrid_attention").is_dir()]
assert importlib.util.find_spec("hybrid_attention") is None
import torch
from transformers import AutoModelForCausalLM
folder, ids = sys.argv[1], torch.tensor([[100, 101, 102, 32, 120]])
try:
    AutoModelForCausalLM.from_pretrained(folder)
except ValueError as e:
    print("without trust_remote_code:", " ".join(str(e).split()))
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
with torch.no_grad():
    torch.save(model(ids).logits, sys.argv[2])
print(type(model).__module__, sys.modules["hybrid_attention"].__file__)
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("remote")
    data = root / "data.txt"
    data.write_text("".join(f"def h{i}(s):\n    return s[{i % 7}:]\n\n" for i in range(300)))
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli.main([str(a) for a in ["train", "--out", root / "run", "--data", data, *ARGS]]) == 0
    return root / "run"


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory):
    out = tmp_path_factory.mktemp("remote") / "tiny-hf"
    assert cli.main(["export", "--ckpt", str(run), "--hf", str(out)]) == 0
    return out


def test_an_export_is_whole_or_absent_and_its_files_are_readable(run, tmp_path, capsys, monkeypatch):
    out = tmp_path / "hf"
    tokenizer = export.hf_tokenizer

    def tokenizer_on_a_full_disk(tok):
        made = tokenizer(tok)
        made.save_pretrained = lambda *a, **k: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device"))
        return made

    monkeypatch.setattr(export, "hf_tokenizer", tokenizer_on_a_full_disk)
    code, _, err = run_cli(["export", "--ckpt", run, "--hf", out], capsys)
    assert code == 1 and "No space left on device" in err and sorted(tmp_path.iterdir()) == []
    monkeypatch.undo()
    (tmp_path / ".hf.partial").mkdir()  # what a killed export leaves
    (tmp_path / ".hf.partial" / "config.json").write_text("{")
    code, out_text, err = run_cli(["export", "--ckpt", run, "--hf", out], capsys)
    assert code == 0 and f"wrote {out}" in out_text, err
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]
    umask = os.umask(0)
    os.umask(umask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert set(modes.values()) == {0o666 & ~umask}, modes  # model.safetensors included (safetensors writes 0600)


def test_the_readme_transformers_example_runs_as_written(run, exported, capsys):
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Use with transformers", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1).replace("runs/tiny-hf", str(exported))
    assert "padding=True" in code
    code = re.sub(r"max_new_tokens=\d+", "max_new_tokens=6", code)  # as written, only shorter
    exec(compile(code, "README.md", "exec"), {})
    rows = eval(capsys.readouterr().out.strip().splitlines()[-1])  # the batch's texts, a printed list
    ours, _, tokenizer = load_run(run)
    for prompt, text in zip(["def ", "import os\n"], rows, strict=True):
        ids = torch.tensor([tokenizer.encode(prompt)])
        alone = generate(ours, ids, 6, temperature=0, eos_token_id=tokenizer.eod_id)[0].tolist()
        # padded on the left, each row as if alone; the end of a document ends it (the export's eos_token)
        assert text == tokenizer.decode(alone).replace("\x00", "")


def test_the_folder_loads_with_trust_remote_code_without_the_package(run, exported, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["HF_MODULES_CACHE"] = str(tmp_path / "modules")
    logits = tmp_path / "logits.pt"
    argv = [sys.executable, "-c", HIDDEN, str(exported), str(logits)]
    done = subprocess.run(
        argv, cwd=tmp_path, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Please pass the argument `trust_remote_code=True`" in done.stdout
    module, package = done.stdout.strip().splitlines()[-1].split()
    assert module.endswith("modeling_hybrid_attention") and package.startswith(str(tmp_path / "modules"))
    ours, _, _ = load_run(run)
    with torch.no_grad():
        expected = ours(torch.tensor([[100, 101, 102, 32, 120]])).logits
    assert rel_err(torch.load(logits), expected) < 1e-6
