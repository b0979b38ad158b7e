"""Realistic, deterministic logs of failing (and healthy) multi-rank training jobs, with ground truth.

    from logdx.synth import generate, SCENARIOS
    with open("job.log", "w") as out:
        truth = generate(out, scenario="xid79", seed=1, ranks=64, lines=2_000_000)

or ``python -m logdx.synth --scenario xid79 --ranks 64 --lines 2000000 --seed 1 -o job.log --truth t.json``.

What a log contains
    launcher start-up (torchrun / srun / DeepSpeed-over-pdsh / mpirun), the framework's banner and
    config dump (Megatron, DeepSpeed+HF Trainer, a torchtitan-style FSDP loop, Lightning, or a plain
    torchrun loop; ``flavour="hf"`` the HF Trainer alone and ``"nemo"`` NeMo, never chosen by "auto"), NCCL INFO init lines of every rank, per-rank progress lines, periodic
    checkpoints and evaluations, harmless noise (deprecation warnings, "0 errors", "error_if_nonfinite
    =False", a recovered wandb ReadTimeout...), then the failure and its cascade: NCCL watchdog
    timeouts, SIGTERMs, ChildFailedError boxes, srun/slurmstepd/pdsh messages. Lines of different
    ranks interleave (tracebacks printed by 64 ranks at once are mixed line by line); each rank's
    timestamps are monotone, with clock skew across ranks.

Knobs
    ``seed`` fixes everything: the same arguments give the same bytes. ``style`` is the prefix
    style (see ``styles.py``), ``flavour`` the framework ("auto": chosen from the seed; DeepSpeed
    for pdsh). ``lines`` is the length of the log the run would have written had it not failed:
    a failure strikes at ``fail_at * lines`` and the log ends with its cascade (a few thousand
    lines at most), so a failed log has about ``fail_at * lines`` lines; healthy logs have about
    ``lines``. Start-up failures (import/syntax errors) ignore ``lines``: nothing else gets
    printed. ``noise`` scales the rate of harmless warnings (0 = none).

Ground truth (``Truth``) conventions
    * ``root_line_no`` / ``root_line``: the first line in the file that shows the root cause (1-based;
      the line exactly as written, prefixes included). For a chained traceback, the first exception
      line; for NaN loss, the first progress line whose loss is NaN; for ``nccl_hang`` (symptoms
      only), the first "Watchdog caught collective operation timeout" line; for ``stall``, the last
      progress line before the silence; for ``node_lost``, srun's "Node failure on HOST" (or pdsh's
      "ssh exited with exit code 255" when launched by pdsh) even though symptoms come earlier.
    * culprits are where the root line came from: ``culprit_ranks`` the ranks that raised/failed
      (all ranks of the lost host for ``node_lost``; the silent rank for ``nccl_hang``), ``culprit_hosts``
      their hosts, ``culprit_gpus`` the PCI bus ids the failure lines print ("0000:8a:00", as in an
      Xid; empty when none is printed). When every rank fails the same way (start-up script errors,
      NaN, a library bug on all ranks) nobody is singled out: all lists are empty.
    * ``stall`` is labelled category ``unknown``, failure_type ``unknown``, action ``restart``: the
      log shows a hang but no cause; a hang without an error is most often transient infrastructure
      and restarting from the last checkpoint is the cheap, safe response, but nothing proves it.
    * ``disk_full`` and ``s3_timeout`` are infrastructure with action ``restart`` (as in the labelled
      dev set); ``host_oom`` and ``dataloader_killed`` are framework/``no_restart`` (a config change
      is needed); ``ecc`` / ``xid79`` / ``nvlink`` are ``cordon_and_restart``.

Layout (to extend it)
    ``scenarios.py`` one function per scenario plus ``REGISTRY`` (its label); ``cascade.py`` the
    symptoms every failure shares (watchdog timeouts, launcher reactions); ``flavours.py`` what each
    framework prints and its code paths for tracebacks; ``training.py`` the healthy part of a log;
    ``styles.py`` prefixes and launchers; ``sink.py`` streaming output and time-ordered bursts;
    ``generate.py`` the public ``generate`` and ``Truth``; ``bury.py`` buries real failure lines (an
    issue-thread excerpt) in a generated healthy job followed by its cascade (``bury``, ``BuriedTruth``;
    used by ``python -m logdx.evaluate``). A new scenario is a function
    ``(job) -> Culprits`` that emits its root line with ``root=True`` and a ``REGISTRY`` entry.

Whole jobs (what ``make eval`` measures beside the excerpts)
    ``noise.py`` the harmless output real multi-node jobs print and run past (c10d store retries at
    start-up, retried downloads and uploads, IB port flaps, fp16 overflow skips, deprecation warnings,
    a loss spike that recovers...; each family's source is in its docstring), as a ``Realism`` profile
    drawn from the job's seed; ``longjob.py`` the ``JobTruth`` of a generated whole job and its
    realistic start; ``healthy.py`` long healthy runs of every framework; ``hangs.py`` silent-rank and
    stack-dump hangs; ``divergence.py`` loss divergences and recovering spikes; ``timeouts.py`` collective
    timeouts of each cause class (cpu_side, misconfig, gpu_hang, network); ``startup.py`` healthy runs whose NCCL
    start-up shows one degradation on one host (or none); ``bury(...,
    realism=True)`` buries a real excerpt in such a job. Each module documents its labels; the truth is
    the generator's, never logdx's.

Realism notes for consumers
    Megatron runs use NGC paths (``/usr/local/lib/python3.10/dist-packages``), not site-packages.
    torch 2.2-era and 2.4-era formats both occur (C++ lines with or without stamps, elastic agent
    lines as ``[2024-..] torch.distributed...: [WARNING]`` or ``W0501 12:00:03.123000 pid file:line]``).
    torchrun's "Root Cause (first observed failure)" box names the first failure *on its node*,
    usually a symptom. Plain ``pdsh`` style carries no rank in the prefix. FSDP logs may carry ANSI
    colour codes. Kernel lines always name their host (syslog or ``host: [dmesg -T]`` form).
"""

from __future__ import annotations

from logdx.synth.cli import main
from logdx.synth.generate import SCENARIOS, Truth, generate

__all__ = ["SCENARIOS", "Truth", "generate", "main"]
