"""The child of test_checkpoint.test_a_full_disk_loses_nothing: runs under a file-size limit
(RLIMIT_FSIZE, SIGXFSZ ignored so that a write past it fails with EFBIG, as on a full disk),
each entry point's stderr caught; prints one JSON object of what happened."""

import contextlib
import io
import json
import resource
import signal
import sys

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

import tests.conftest  # noqa: E402,F401 - the suite's fast XLA flags and 8 CPU devices
from experiments.run import main  # noqa: E402
from jaxdist.files import write_json  # noqa: E402

d = sys.argv[1]
base = ["--mesh", "2x4", "--layout", "fsdp", "--model", "mlp-tiny", "--batch-size", "16",
        "--warmup", "1", "--no-progress", "--checkpoint-dir", f"{d}/ck"]
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
out = {}


def run(name, argv, limit=None):
    err = io.StringIO()
    if limit:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(argv)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    out[name] = [code, err.getvalue()]


run("first", [*base, "--steps", "1", "--checkpoint-every", "1", "--logdir", f"{d}/a"])
# a checkpoint's data file is ~45 KB, results.json ~10 KB, the events file ~6 KB
run("checkpoint", [*base, "--steps", "3", "--checkpoint-every", "1", "--resume",
                   "--logdir", f"{d}/b"], limit=20_000)
run("events", [*base[:-2], "--steps", "200", "--logdir", f"{d}/e"], limit=1_000)
before = open(f"{d}/a/results.json").read()
resource.setrlimit(resource.RLIMIT_FSIZE, (4_000, hard))
try:
    write_json(__import__("pathlib").Path(f"{d}/a/results.json"), {"x": "y" * 8_000})
    out["results"] = "written"
except Exception as e:  # noqa: BLE001 - whatever write_json raises is compared
    out["results"] = str(e)
finally:
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
out["results_kept"] = open(f"{d}/a/results.json").read() == before
run("resumed", [*base, "--steps", "3", "--resume", "--logdir", f"{d}/c"])
print(json.dumps(out))
