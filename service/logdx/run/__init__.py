"""`logdx run [options] -- CMD ARGS...`: run a training job, watch its logs, diagnose and restart it.

The command's stdout and stderr pass through to ours unchanged, byte for byte and as they come;
every line also goes to one pipeline `Session` (the same one `diagnose` and the service use).
An attempt ends when

- the command exits (trigger `exit`, or `ok` for exit code 0);
- a root cause was seen (an Xid on one rank, say) and the job did not die by itself within
  `--root-cause-grace` seconds, nor made progress since: the other ranks are hanging
  (trigger `root_cause`);
- no training progress line came for `--stall-timeout` seconds (trigger `stall`; by default
  max(stall_factor x the median step interval, detect.stall_min_s), armed once the step time
  is known);
- the loss turned NaN or spiked (triggers `loss_nan`, `loss_spike`; see `--loss-trigger`);
- logdx was interrupted (SIGINT/SIGTERM/SIGHUP are forwarded to the job's process group;
  trigger `interrupted`, never restarted).

logdx ends a job with SIGTERM to its process group and SIGKILL after `--kill-grace` seconds.
Each attempt is diagnosed; infrastructure failures (or the categories of `--restart-on`) are
restarted at most `--max-restarts` times with exponential backoff. Before a restart the culprit
node is cordoned through `Actions` (dry-run unless enabled) and excluded from the next launch:
`LOGDX_EXCLUDE_HOSTS` (always set, accumulated) and `--exclude-arg`; `--resume-arg` points the
restart at the last checkpoint the log says was saved. logdx exits with the last attempt's exit
code (128+N when it was killed by signal N).

One module a concern: `options` (what was asked, what happened), `checkpoints` (the last checkpoint
the log says was saved), `child` (the process, its pipes, the watch), `restart` (the restart
policy), `supervisor` (the loop over attempts), `cli` (its argparse).
"""

from __future__ import annotations

from logdx.run.checkpoints import Checkpoint, CheckpointTracker
from logdx.run.cli import add_run_parser, cmd_run, main
from logdx.run.options import TRIGGERS, Attempt, RunOptions
from logdx.run.restart import fill_template

__all__ = [
    "TRIGGERS",
    "Attempt",
    "Checkpoint",
    "CheckpointTracker",
    "RunOptions",
    "add_run_parser",
    "cmd_run",
    "fill_template",
    "main",
]
