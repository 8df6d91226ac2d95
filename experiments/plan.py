"""A plan: `python -m experiments.plan --layout fsdp --mesh 4x8 --model gpt-tiny`.

What a layout costs before anything runs, from the train state's shapes, or with
`--hardware PART` predicted from the step compiled for that cluster (jaxdist.plan). The
same flags, checks and step as experiments.run, which plans the same with `--dry-run`.
"""

from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C while JAX is imported: noted, then handled like any other
    from jaxdist.stop import defer_signals
    defer_signals()

from experiments import run  # noqa: E402

PLAN = ("plan", "Plan one model under one layout on a device mesh without running it: the "
                "memory each device holds from the train state's shapes, or with --hardware "
                "PART the step compiled for that cluster (XLA:GPU, no GPU needed) and its "
                "predicted time and memory. Takes experiments.run's flags (--dry-run is "
                "implied).")


def build_parser():
    return run.build_parser(PLAN)


def main(argv=None) -> int:
    return run.main(argv, PLAN)


if __name__ == "__main__":
    run.exit_process(main())
