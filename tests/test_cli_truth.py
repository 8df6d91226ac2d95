"""The command line tells the whole truth: --help and the README name every registered model,
dataset and layout; `--xla-flags VALUE` takes a value beginning with "--"; a flag that does
nothing here is one notice line; a bad batch names the nearest valid sizes; the SLURM
scripts log into a folder a fresh clone has."""

import re
import subprocess
from pathlib import Path

import pytest

from experiments.run import build_parser
from experiments.validation import check_batch
from jaxdist.config import CheckpointConfig, CompilerConfig, DataConfig, ModelConfig
from jaxdist.config import OutputConfig, PSConfig
from jaxdist.config import RunConfig, TrainConfig
from jaxdist.data import DATASETS
from jaxdist.errors import UsageError
from jaxdist.mesh import MeshShape
from experiments.notices import notices
from jaxdist.record import RunRecord
from models import model_names
from sharding import layout_names
from tests.helpers import run_cli

ROOT = Path(__file__).resolve().parent.parent
REGISTERED = ([("model", n) for n in model_names()] + [("dataset", n) for n in DATASETS] +
              [("layout", n) for n in layout_names()])


def _code_words(markdown: str) -> set[str]:
    """Every word inside a `code span` (`--dataset digits` -> --dataset, digits)."""
    return {w for span in re.findall(r"`([^`\n]+)`", markdown)
            for w in re.split(r"[\s,/|=()]+", span) if w}


@pytest.mark.parametrize("kind, name", REGISTERED, ids=[f"{k}:{n}" for k, n in REGISTERED])
def test_readme_names_every_registered_name(kind, name):
    assert name in _code_words((ROOT / "README.md").read_text()), (
        f"README.md does not mention the registered {kind} `{name}`")


def test_help_lists_every_registered_name_whole(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")  # a terminal's width: names must not break at '-'
    text = build_parser().format_help()
    words = set(re.split(r"[\s,;:{}()]+", text))
    missing = [name for _, name in REGISTERED if name not in words]
    assert missing == []
    assert "see --help" not in text  # the help is the list, not a pointer to itself


# ---- --xla-flags ------------------------------------------------------------------------

@pytest.mark.parametrize("argv, value", [
    (["--xla-flags", "--xla_foo=1"], "--xla_foo=1"),
    (["--xla-flags", "--xla_foo=1 --xla_bar"], "--xla_foo=1 --xla_bar"),
    (["--xla-flags=--xla_foo=1 --xla_bar"], "--xla_foo=1 --xla_bar"),
    (["--xla-flags", "--xla_foo", "--steps", "3"], "--xla_foo"),
])
def test_xla_flags_take_a_value_beginning_with_dashes(argv, value):
    assert build_parser().parse_args(argv).xla_flags == value


@pytest.mark.parametrize("argv, message", [
    (["--xla-flags", "--steps", "3"], "argument --xla-flags: expected one argument"),
    (["--xla-flags"], "argument --xla-flags: expected one argument"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_other_parse_errors_stay_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


# ---- batch ------------------------------------------------------------------------------

@pytest.mark.parametrize("batch, mesh, micro, suggestion", [
    (65, MeshShape(8), 1, "use a multiple of 8, e.g. --batch-size 64 or 72"),
    (5, MeshShape(8), 1, "use a multiple of 8, e.g. --batch-size 8"),
    (100, MeshShape(2, 4), 3, "use a multiple of 24, e.g. --batch-size 96 or 120"),
    (30, MeshShape(2, 2, 2), 1, "use a multiple of 4, e.g. --batch-size 28 or 32"),  # tensor
])
def test_bad_batch_names_the_nearest_sizes_both_ways(batch, mesh, micro, suggestion):
    cfg = RunConfig(train=TrainConfig(batch_size=batch, microbatches=micro))
    with pytest.raises(UsageError) as err:
        check_batch(cfg, mesh)
    assert str(err.value).endswith(suggestion)


# ---- notices ----------------------------------------------------------------------------

NOTICES = [
    (RunConfig(), []),
    (RunConfig(ps=PSConfig(ps_shards=4)),
     ["notice: --ps-shards applies only to --layout ps; ignored"]),
    (RunConfig(ps=PSConfig(ps_shards=4, staleness=5, ps_mode="async")),
     ["notice: --ps-shards, --ps-mode, --staleness apply only to --layout ps; ignored"]),
    (RunConfig(train=TrainConfig(layout="ps"), ps=PSConfig(staleness=5)),
     ["notice: --staleness applies only to --ps-mode ssp; ignored"]),
    (RunConfig(train=TrainConfig(layout="ps"), ps=PSConfig(staleness=5, ps_mode="ssp")), []),
    (RunConfig(train=TrainConfig(layout="ps"),
               ps=PSConfig(ps_mode="async", ps_drop_dead_workers=True)),
     ["notice: --ps-drop-dead-workers applies only to --ps-mode sync (async and ssp go on "
      "without a dead worker anyway); ignored"]),
    (RunConfig(checkpoint=CheckpointConfig(checkpoint_dir="ck")),
     ["notice: --checkpoint-every 0: no checkpoint is saved in --checkpoint-dir unless the "
      "run is interrupted; add --checkpoint-every N to save every N steps"]),
    (RunConfig(checkpoint=CheckpointConfig(checkpoint_dir="ck", checkpoint_every=5)), []),
    (RunConfig(checkpoint=CheckpointConfig(checkpoint_dir="ck", resume=True)), []),
    (RunConfig(data=DataConfig(data_dir="/data")),
     ["notice: --data-dir applies only to --dataset cifar10 or mnist; ignored"]),
    (RunConfig(data=DataConfig(dataset="mnist", data_dir="/data")), []),
    (RunConfig(model=ModelConfig(dtype="bfloat16", matmul_precision="highest")),
     ["notice: --matmul-precision applies only to --dtype float32; ignored"]),
    (RunConfig(output=OutputConfig(dry_run=True), ps=PSConfig(ps_shards=4),
               checkpoint=CheckpointConfig(checkpoint_dir="ck"),
               train=TrainConfig(batch_size=256)),
     ["notice: --batch-size, --checkpoint-dir apply only to a training run, not --dry-run "
      "(which plans memory from shapes only); ignored",
      "notice: --ps-shards applies only to --layout ps; ignored"]),
    # --hardware compiles the step: --xla-flags go to its compiles
    (RunConfig(output=OutputConfig(dry_run=True, hardware="h200"),
               compiler=CompilerConfig(xla_flags="--xla_gpu_enable_triton_gemm=false")), []),
    (RunConfig(output=OutputConfig(dry_run=True),
               compiler=CompilerConfig(xla_flags="--xla_gpu_enable_triton_gemm=false")),
     ["notice: --xla-flags applies only to a training run, not --dry-run (which plans memory "
      "from shapes only); ignored"]),
    (RunConfig(output=OutputConfig(dry_run=True), train=TrainConfig(seed=3, lr=0.1)),
     ["notice: --seed, --lr apply only to a training run, not --dry-run (which plans memory "
      "from shapes only); ignored"]),
]


@pytest.mark.parametrize("cfg, expected", NOTICES, ids=range(len(NOTICES)))
def test_notices(cfg, expected):
    assert notices(cfg) == expected


def test_notices_through_the_cli(tmp_path):
    """A real (tiny) run: the flags that do nothing are named once on stderr, the run goes
    on, --xla-flags given as a separate word reaches XLA, and no checkpoint is written."""
    logdir, ckpt = tmp_path / "run", tmp_path / "ck"
    proc = run_cli("--model", "mlp-tiny", "--mesh", "2", "--batch-size", "4", "--warmup", "0",
                   "--steps", "1", "--ps-shards", "4", "--checkpoint-dir", str(ckpt),
                   "--xla-flags", "--xla_backend_optimization_level=0",
                   "--logdir", str(logdir), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    notice_lines = [line for line in proc.stderr.splitlines() if line.startswith("notice:")]
    assert notice_lines == [
        "notice: --ps-shards applies only to --layout ps; ignored",
        "notice: --checkpoint-every 0: no checkpoint is saved in --checkpoint-dir unless the "
        "run is interrupted; add --checkpoint-every N to save every N steps"]
    results = RunRecord.load(logdir).results
    assert "--xla_backend_optimization_level=0" in results["env"]["xla_flags"].split()
    assert results["checkpoint"]["saved_steps"] == []


# ---- SLURM ------------------------------------------------------------------------------

SBATCH = sorted((ROOT / "scripts" / "slurm").glob("*.sbatch"))
_LOG_OPTION = re.compile(r"^#SBATCH\s+(?:--output|--error|-o|-e)[=\s]\s*(\S+)")


def _tracked_dirs() -> set[str]:
    """Folders a fresh clone has: those holding a file git tracks ("" is the clone's root)."""
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    return {"" if str(d) == "." else str(d) for f in files for d in Path(f).parents}


@pytest.mark.parametrize("script", SBATCH, ids=[s.name for s in SBATCH])
def test_sbatch_logs_go_to_a_folder_a_fresh_clone_has(script):
    """SLURM opens --output/--error before the script runs and does not create the folder:
    a log aimed at runs/ (made only by a run) is lost on a fresh clone's first job."""
    logs = [m.group(1) for line in script.read_text().splitlines()
            if (m := _LOG_OPTION.match(line))]
    assert logs, f"{script.name} names no --output"
    tracked = _tracked_dirs()
    for log in logs:
        folder = str(Path(log).parent)
        folder = "" if folder == "." else folder
        assert not Path(log).is_absolute() and folder in tracked, (
            f"{script.name}: #SBATCH log {log} is in {folder!r}, which a fresh clone lacks")
