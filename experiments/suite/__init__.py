"""Study suites: `python -m experiments.suite --preset ovi2025 --out DIR [--quick]`.

A preset (a TOML file in experiments/presets/, or any path) lists models, layout entries,
variants and settings; the suite expands them into runs and starts each one as a fresh
`python -m experiments.run ... --logdir DIR/<run-name>` process, so peak-memory counters and
compilation caches start from zero. Runs are interleaved (every layout of a model in turn,
the starting layout rotated each repeat) so slow drift of a shared machine is spread over the
layouts instead of looking like a layout effect.

A failed run (non-zero exit, killed, timed out) is recorded with its exit status and the tail
of its stderr, and the suite goes on. Finished runs (those with results.json) are skipped, so
the same command resumes an interrupted suite. State: DIR/suite.json (every run: command,
status, seconds, stderr tail) and DIR/logs/<run-name>.{out,err,status.json}.

Preset format, report and the commands of the two studies: docs/suite.md.

Modules, in the order a suite uses them: settings (run keys and values), presets (the TOML
file), matrix (the runs, in order), runner (running them), cli (the command line); plan
(`--plan --hardware PART`: the preset's [plan] rows predicted, nothing run).
"""
