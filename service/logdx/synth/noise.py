"""Harmless output real multi-node jobs print, that a job runs past for hours.

A ``Realism`` profile is drawn once per job from the job's own random generator (so a job stays
deterministic in its seed) and switches on a subset of the families below; the whole-job generators
(``bury.bury(..., realism=True)``, ``healthy.py``, ``hangs.py``, ``divergence.py``) attach it to the job,
and the healthy part of the log calls its hooks: ``at_launch`` (after the launchers' banner),
``at_startup`` (after the framework's banner), ``after_step`` (after every log step) and ``at_finish``
(after a successful end). A job without a profile writes exactly what it always wrote.

Every family is something a job recovers from or ignores: none of them is ever the root cause, and
none ends a rank's progress. The message strings are the real ones; where each family comes from:

``job_preamble``    what the batch script prints before launching: its own echo lines (job id, nodes,
                    ``MASTER_ADDR``) and the ``nvidia-smi`` table of the first node (driver's standard
                    layout, with its ``Volatile Uncorr. ECC`` column and ``No running processes found``).
``store_retries``   torch's c10d TCPStore client while the rendezvous store is not up yet:
                    ``[W socket.cpp:663] [c10d] The client socket has failed to connect to [host]:29500
                    (errno: 111 - Connection refused).`` (torch 2.1-2.3; torch >= 2.4 stamps it
                    ``[W1226 15:35:11.626067741 socket.cpp:752]``). Quoted in pytorch/pytorch#113868,
                    hpcaitech/Open-Sora#667, hiyouga/LlamaFactory#3715, sgl-project/sglang#2561; logdx
                    issue 19 found it on most multi-node torchrun jobs.
``srun_step_retry`` Slurm's srun: ``srun: Job 5517045 step creation temporarily disabled, retrying
                    (Requested nodes are busy)`` then ``srun: Step created for StepId=5517045.1``
                    (srun's own source, and NERSC's and pyxis users' posts).
``ssh_known_hosts`` OpenSSH when pdsh / mpirun reach a node first: ``Warning: Permanently added
                    'node-03,10.0.0.3' (ED25519) to the list of known hosts.``
``openmpi_openib``  Open MPI 4 with UCX on InfiniBand: the "By default, for Open MPI 4.0 and later,
                    infiniband ports on a device are not used by default" and "WARNING: There was an error
                    initializing an OpenFabrics device." help blocks and the "N more processes have sent
                    help message help-mpi-btl-openib.txt / ib port not selected" aggregation (Open MPI
                    users' list; a Slurm user's post in Spanish quotes all three).
``hub_retries``     huggingface_hub's ``http_backoff``: ``'(ReadTimeoutError("HTTPSConnectionPool(host=
                    'huggingface.co', port=443): Read timed out. (read timeout=10)"), '(Request ID: ...)')'
                    thrown while requesting HEAD https://huggingface.co/...`` then ``Retrying in 1s [Retry
                    1/5].`` (AUTOMATIC1111/stable-diffusion-webui#17165, vLLM users' logs).
``s3_retries``      urllib3's connection pool (boto/requests-based shard readers): ``WARNING:urllib3.
                    connectionpool:Retrying (Retry(total=4, connect=None, read=None, redirect=None,
                    status=None)) after connection broken by 'ProtocolError('Connection aborted.',
                    ConnectionResetError(104, 'Connection reset by peer'))': /path`` (pip's and docker
                    build logs quote the same urllib3 line).
``wandb_retries``   ``wandb: Network error (ConnectionError), entering retry loop.`` (wandb's own FAQ
                    "How do I deal with network issues?"; ReadTimeout / TransientError variants in users'
                    logs).
``ib_flap``         NCCL's IB async thread (transport/net_ib.cc): ``NCCL WARN NET/IB : mlx5_0:1 Got
                    async event : port error`` and later ``... : port active`` on every rank of one node
                    (format from NVIDIA/nccl#1710; event names are libibverbs' ``ibv_event_type_str``;
                    NVIDIA/nccl#1819 for "GID table change"). The link comes back; training goes on.
``overflow``        fp16 dynamic loss scaling. DeepSpeed: ``[loss_scaler.py:183:update_scale] [deepspeed]
                    OVERFLOW! Rank 0 Skipping step. Attempted loss scale: 16384, reducing to 8192``,
                    ``[fused_optimizer.py:345:_update_scale] Reducing dynamic loss scale from 65536 to
                    32768.0`` with ``[logging.py:96:log_dist] [Rank 0] Overflow detected. Skipping step.
                    Attempted loss scale: 65536, reducing to 32768.0`` (DeepSpeed's fused_optimizer.py,
                    loss_scaler.py and users' logs); Megatron prints ``number of skipped iterations`` and
                    the ``loss scale`` in its progress line. A few skips in the first iterations are the
                    scaler finding its scale, then one now and then.
``deprecations``    torch's ``UserWarning: torch.utils.checkpoint: the use_reentrant parameter should be
                    passed explicitly...`` and DDP's ``[W reducer.cpp:1389] Warning:
                    find_unused_parameters=True was specified in DDP constructor, but did not find any
                    unused parameters in the forward pass...`` (torch's reducer.cpp / checkpoint.py).
``batch_size_finder`` Lightning's BatchSizeFinder: ``Batch size 16 failed, trying batch size 8`` (a CUDA
                    OOM it caught), ``Finished batch size finder, will continue with full run using batch
                    size 8``, ``Restoring states from the checkpoint path at .../.scale_batch_size_<uuid>.ckpt``
                    (Lightning users' issue threads).
``error_words``     "error" and "nan" in names and settings: a dataset mix with an error-correction corpus,
                    a data loader's ``on_error``/``max_bad_samples`` settings (the user's own config), HF's
                    ``logging_nan_inf_filter=True``.
``grad_clip``       the hand-written loop's own note when it clips a large gradient norm (the user's own
                    format: no framework prints one).
``spike``           a loss spike that recovers within a few log steps (bigscience-workshop/Megatron-
                    DeepSpeed#57: "a 3->8->3 spike ... recovered after a few hours of training").
``exit_warnings``   torch >= 2.4 at exit: ``[rank0]:[W530 18:29:40.437973137 ProcessGroupNCCL.cpp:1250]
                    Warning: WARNING: process group has NOT been destroyed before we destruct
                    ProcessGroupNCCL...`` on every rank; wandb's ``Waiting for W&B process to finish...
                    (success).`` and ``Synced N W&B file(s)`` summary.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field

from logdx.synth.job import Job
from logdx.synth.sink import Burst

FAMILIES = ("job_preamble", "store_retries", "srun_step_retry", "ssh_known_hosts", "openmpi_openib", "hub_retries", "s3_retries",
            "wandb_retries", "ib_flap", "overflow", "deprecations", "batch_size_finder", "error_words", "grad_clip",
            "spike", "exit_warnings")

_HUB_REPOS = ("meta-llama/Meta-Llama-3-8B", "mistralai/Mistral-7B-v0.1", "EleutherAI/gpt-neox-20b",
              "Qwen/Qwen2.5-7B", "allenai/OLMo-7B")
_HUB_FILES = ("config.json", "tokenizer_config.json", "tokenizer.json", "generation_config.json")
_BUCKETS = ("pretrain-shards", "lm-data-prod", "ml-datasets-us-east-1", "tokenized-corpus")


@dataclass
class Spike:
    """A loss spike starting at log step ``start``: ``height`` times the loss, decaying over ``tau`` steps."""

    start: int
    height: float
    tau: float

    def apply(self, job: Job) -> None:
        k = job.step - self.start
        if k >= 0 and not job.nan:
            bump = math.exp(-k / self.tau)
            job.loss += self.height * job.loss * bump
            job.grad_norm *= 1.0 + 12.0 * bump


@dataclass
class Realism:
    """The harmless families one job prints (see the module docstring) and its bookkeeping."""

    families: frozenset[str]
    hub_repo: str = ""
    master_addr: str = ""  # how the c10d client names the store: [host], [::ffff:ip] or ip
    spike: Spike | None = None
    ib_flap_step: int = -1
    ib_flap_host: int = 0
    ib_dev: str = "mlx5_0"
    scale_pow: int = 16  # fp16 loss scale = 2 ** scale_pow
    iters_since_skip: int = 0
    notes: list[str] = field(default_factory=list)  # what was written, for the truth / tests

    @classmethod
    def draw(cls, job: Job, *, steps: int, exclude: frozenset[str] = frozenset()) -> Realism:
        """A profile for ``job``, expected to run about ``steps`` log steps. Families that do not fit
        the job (Slurm retries without Slurm, a batch-size finder outside Lightning...) are left out."""
        rng, c, style = job.rng, job.cluster, job.style
        chosen: set[str] = set()
        multi_node = c.n_hosts > 1
        if multi_node and rng.random() < (0.85 if style.launcher == "torchrun" else 0.6):
            chosen.add("store_retries")
        if job.slurm and rng.random() < 0.4:
            chosen.add("srun_step_retry")
        if (style.launcher in ("deepspeed", "mpirun") or style.name.startswith("pdsh")) and rng.random() < 0.6:
            chosen.add("ssh_known_hosts")
        if style.launcher == "mpirun" and rng.random() < 0.7:
            chosen.add("openmpi_openib")
        for name, p in (("job_preamble", 0.5), ("hub_retries", 0.45), ("s3_retries", 0.35), ("wandb_retries", 0.45), ("ib_flap", 0.35),
                        ("deprecations", 0.7), ("error_words", 0.5), ("exit_warnings", 0.9)):
            if rng.random() < p:
                chosen.add(name)
        if job.flavour.name in ("deepspeed", "megatron") and rng.random() < 0.5:
            chosen.add("overflow")
        if job.flavour.name == "lightning" and rng.random() < 0.6:
            chosen.add("batch_size_finder")
        if job.flavour.name == "plain" and rng.random() < 0.7:
            chosen.add("grad_clip")
        if steps >= 40 and rng.random() < 0.35:
            chosen.add("spike")
        chosen -= exclude
        profile = cls(frozenset(chosen))
        profile.hub_repo = rng.choice(_HUB_REPOS)
        master = c.hosts[0]
        profile.master_addr = rng.choice((f"[{master}]", f"[::ffff:{c.ips[0]}]", f"[{master}]"))
        if "spike" in chosen:
            profile.spike = Spike(start=rng.randrange(steps // 4, max(steps // 4 + 1, 3 * steps // 5)),
                                  height=rng.uniform(0.6, 1.6), tau=rng.uniform(1.0, 3.0))
        if "ib_flap" in chosen:
            # Within the first two thirds of the steps the job is expected to write (an estimate that runs
            # high for many ranks): a log cut while the job trains still shows the port coming back. A flap
            # whose recovery the log never shows is, from the log, a port that stayed down.
            profile.ib_flap_step = rng.randrange(2, max(3, 2 * steps // 3))
            profile.ib_flap_host = rng.randrange(c.n_hosts)
        if "overflow" in chosen:
            job.flavour.fp16 = True
            profile.scale_pow = 16 if job.flavour.name == "deepspeed" else 32
        return profile

    def attach(self, job: Job) -> None:
        job.realism = self
        if self.spike is not None:
            job.step_hooks.append(self.spike.apply)
        if "overflow" in self.families and job.flavour.name == "megatron":
            job.step_hooks.append(self.megatron_scaler)

    # -- hooks ---------------------------------------------------------------------------------

    def at_begin(self, job: Job) -> None:
        """Before the launchers: the batch script's own lines."""
        if "job_preamble" in self.families:
            for line in _preamble(job):
                job.sink.emit(line)

    def at_launch(self, job: Job) -> None:
        """After the launchers' banner, before the ranks have met: scheduler, ssh and store noise."""
        burst = job.burst()
        t = job.now - 24.0
        if "srun_step_retry" in self.families:
            jid = job.cluster.slurm_job_id
            burst.add(t - 30.0, f"srun: Job {jid} step creation temporarily disabled, retrying (Requested nodes are busy)")
            burst.add(t - 30.0 + job.rng.uniform(5, 60), f"srun: Step created for StepId={jid}.0")
        if "ssh_known_hosts" in self.families:
            for h in range(job.cluster.n_hosts):
                burst.add(t - 2.0 + 0.01 * h, f"Warning: Permanently added '{job.cluster.hosts[h]},"
                                              f"{job.cluster.ips[h]}' (ED25519) to the list of known hosts.")
        if "openmpi_openib" in self.families:
            _openmpi_openib(job, burst, t - 1.0)
        if "store_retries" in self.families:
            self._store_retries(job, burst, t)
        job.now = max(job.now, burst.drain(job.sink))

    def at_startup(self, job: Job) -> None:
        """After the framework's banner, before training: downloads, finders, config, first warnings."""
        burst = job.burst()
        if "hub_retries" in self.families:
            self._hub_retries(job, burst)
        if "error_words" in self.families:
            _error_words(job, burst)
        if "batch_size_finder" in self.families:
            _batch_size_finder(job, burst)
        if "deprecations" in self.families:
            _deprecations(job, burst)
        job.now = max(job.now, burst.drain(job.sink))

    def after_step(self, job: Job) -> None:
        rng = job.rng
        fam = self.families
        if "overflow" in fam and job.flavour.name == "deepspeed":
            self._deepspeed_scaler(job)
        if "ib_flap" in fam and job.step in (self.ib_flap_step, self.ib_flap_step + 1):
            self._ib_event(job, "port error" if job.step == self.ib_flap_step else "port active")
        if "s3_retries" in fam and rng.random() < 0.03:
            rank = rng.randrange(job.cluster.world_size)
            job.sink.emit(job.prefixes[rank] + _urllib3_retry(job))
        if "wandb_retries" in fam and rng.random() < 0.02:
            kind = rng.choice(("ConnectionError", "ReadTimeout", "TransientError"))
            job.sink.emit(job.prefixes[0] + f"wandb: Network error ({kind}), entering retry loop.")
        if "grad_clip" in fam and (job.grad_norm > 1.0 or rng.random() < 0.02):
            norm = max(job.grad_norm, rng.uniform(1.05, 3.0))
            job.sink.emit(job.prefixes[0] + f"{job.clock.py(job.rank_time(0))} - WARNING - train.py:181 - grad norm "
                                            f"{norm:.3f} > max_norm 1.0: clipped (scale {1.0 / norm:.3f})")

    def at_finish(self, job: Job) -> None:
        """After a successful end: torch's exit warning on every rank, wandb's upload summary."""
        if "exit_warnings" not in self.families:
            return
        burst = job.burst()
        rng = job.rng
        if job.new_torch:
            for rank in range(job.cluster.world_size):
                p = job.rank_proc(burst, rank, job.rank_time(rank) + rng.uniform(0.5, 3.0))
                p.say(job.c10("W", p.t, "ProcessGroupNCCL.cpp:1250") + "Warning: WARNING: process group has NOT been "
                      "destroyed before we destruct ProcessGroupNCCL. On normal program exit, the application should "
                      "call destroy_process_group to ensure that any pending NCCL operations have finished in this "
                      "process. In rare cases this process can exit before this point and block the progress of "
                      "another member of the process group. This constraint has always been present,  but this "
                      "warning has only been added since PyTorch 2.4 (function operator())")
        run_id = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(8))
        p = job.rank_proc(burst, 0, job.rank_time(0) + 0.2)
        for text in ("wandb: Waiting for W&B process to finish... (success).",
                     f"wandb: 🚀 View run {job.run_name} at: https://wandb.ai/team/{job.run_name.split('-')[0]}/runs/{run_id}",
                     f"wandb: Synced 6 W&B file(s), 0 media file(s), {rng.randrange(0, 4)} artifact file(s) and 0 other "
                     "file(s)",
                     f"wandb: Find logs at: ./wandb/run-{job.clock.underscored(p.t).replace('-', '').replace(':', '')}"
                     f"-{run_id}/logs"):
            p.say(text, 0.05)
        job.now = max(job.now, burst.drain(job.sink))

    # -- families ------------------------------------------------------------------------------

    def _store_retries(self, job: Job, burst: Burst, t: float) -> None:
        """Nodes (their torchrun agents, or the ranks themselves) dial the store before it listens."""
        c, rng = job.cluster, job.rng
        where = "socket.cpp:752" if job.new_torch else "socket.cpp:663"
        port = c.master_port
        text = f"[c10d] The client socket has failed to connect to {self.master_addr}:{port} (errno: 111 - Connection refused)."
        early = [h for h in range(1, c.n_hosts) if rng.random() < 0.7] or [c.n_hosts - 1]
        for h in early:
            if job.style.launcher == "torchrun":
                p = job.agent_proc(burst, h, t + rng.uniform(0.0, 2.0))
            else:  # no agent: each rank's init_process_group dials the store itself
                p = job.rank_proc(burst, c.ranks_on(h)[rng.randrange(len(c.ranks_on(h)))], t + rng.uniform(0.0, 2.0))
            for _ in range(rng.randint(1, 5)):
                p.say(job.c10("W", p.t, where) + text, rng.uniform(0.5, 2.5))
        self.notes.append(f"store_retries from {len(early)} node(s)")

    def _hub_retries(self, job: Job, burst: Burst) -> None:
        c, rng = job.cluster, job.rng
        f = rng.choice(_HUB_FILES)
        url = f"https://huggingface.co/{self.hub_repo}/resolve/main/{f}"
        prefix = rng.choice(("", "WARNING:huggingface_hub.utils._http:"))
        for h in sorted(rng.sample(range(c.n_hosts), min(c.n_hosts, rng.randint(1, 3)))):
            p = job.rank_proc(burst, c.ranks_on(h)[0], job.rank_time(c.ranks_on(h)[0]) + rng.uniform(0.5, 3.0))
            for attempt in range(1, rng.randint(2, 3)):
                err = (f"'(ReadTimeoutError(\"HTTPSConnectionPool(host='huggingface.co', port=443): Read timed out. "
                       f"(read timeout=10)\"), '(Request ID: {uuid.UUID(int=rng.getrandbits(128))})')' thrown while "
                       f"requesting HEAD {url}")
                p.say(prefix + err, 10.0)
                p.say(prefix + f"Retrying in {2 ** (attempt - 1)}s [Retry {attempt}/5].", 0.001)

    def _ib_event(self, job: Job, event: str) -> None:
        """NCCL's async thread of every rank on one node reports the same port event."""
        c, rng = job.cluster, job.rng
        h = self.ib_flap_host
        if event == "port error":
            self.ib_dev = f"mlx5_{rng.randrange(4)}"
            self.notes.append(f"ib_flap on {c.hosts[h]} {self.ib_dev}")
        dev = self.ib_dev
        for rank in c.ranks_on(h):
            tid = job.nccl_tids[rank] + 71
            head = f"{c.host(rank)}:{c.worker_pids[rank]}:{tid} [{c.local_rank(rank)}]"
            job.sink.emit(job.prefixes[rank] + f"{head} transport/net_ib.cc:101 NCCL WARN NET/IB : {dev}:1 Got async "
                                               f"event : {event}")

    def _deepspeed_scaler(self, job: Job) -> None:
        """Overflow skips: several in the first steps, then now and then; the scale regrows."""
        rng = job.rng
        skips = rng.randint(1, 3) if job.step <= 2 else int(rng.random() < 0.03)
        stage = getattr(job.flavour, "stage", 1)
        for _ in range(skips):
            scale = 2 ** self.scale_pow
            t = job.clock.py(job.rank_time(0) + 0.02)
            if stage == 3:
                text = (f"[{t}] [INFO] [stage3.py:1834:_overflow_clean_up] [deepspeed] OVERFLOW! Rank 0 Skipping step. "
                        f"Attempted loss scale: {scale}, reducing to {scale // 2}")
                job.sink.emit(job.prefixes[0] + text)
            elif rng.random() < 0.5:
                job.sink.emit(job.prefixes[0] + f"[{t}] [INFO] [loss_scaler.py:183:update_scale] [deepspeed] OVERFLOW! "
                                                f"Rank 0 Skipping step. Attempted loss scale: {scale}, reducing to "
                                                f"{scale // 2}")
            else:
                job.sink.emit(job.prefixes[0] + f"[{t}] [INFO] [fused_optimizer.py:345:_update_scale] Reducing dynamic "
                                                f"loss scale from {scale} to {scale / 2}")
                job.sink.emit(job.prefixes[0] + f"[{t}] [INFO] [logging.py:96:log_dist] [Rank 0] Overflow detected. "
                                                f"Skipping step. Attempted loss scale: {scale}, reducing to {scale / 2}")
            self.scale_pow = max(0, self.scale_pow - 1)
            job.skipped_total += 1

    def megatron_scaler(self, job: Job) -> None:
        """Megatron fp16: skipped iterations per log interval and the loss scale in the progress line."""
        rng = job.rng
        iters = job.flavour.iters_per_step
        skips = rng.randint(2, min(6, iters)) if job.step <= 2 else int(rng.random() < 0.03)
        self.scale_pow = max(0, self.scale_pow - skips)
        self.iters_since_skip = 0 if skips else self.iters_since_skip + iters
        if self.iters_since_skip >= 1000:  # loss_scale_window: no overflow for a while, the scale grows back
            self.scale_pow += 1
            self.iters_since_skip = 0
        job.skipped_iters = skips
        job.loss_scale = float(2 ** self.scale_pow)


def _preamble(job: Job) -> list[str]:
    c, rng = job.cluster, job.rng
    t = job.now - rng.uniform(40.0, 90.0)
    driver = rng.choice(("535.161.08", "550.54.15", "550.90.07"))
    cuda = {"535.161.08": "12.2", "550.54.15": "12.4", "550.90.07": "12.4"}[driver]
    mib = 81559 if c.gpu_model == "H100" else 81920
    watts = 700 if c.gpu_model == "H100" else 400
    out = [f"Job {c.slurm_job_id} starting at {job.clock.dmesg(t)} on {c.n_hosts} node(s): {','.join(c.hosts[:8])}"
           + ("..." if c.n_hosts > 8 else ""),
           f"MASTER_ADDR={c.hosts[0]} MASTER_PORT={c.master_port} WORLD_SIZE={c.world_size}",
           f"{job.clock.dmesg(t + 1.0)}       ",
           "+-----------------------------------------------------------------------------------------+",
           f"| NVIDIA-SMI {driver}              Driver Version: {driver}      CUDA Version: {cuda}     |",
           "|-----------------------------------------+------------------------+----------------------+",
           "| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |",
           "| Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage | GPU-Util  Compute M. |",
           "|                                         |                        |               MIG M. |",
           "|=========================================+========================+======================|"]
    for g in range(c.gpus_per_host):
        bus = c.bus_ids[g].upper().replace("0000:", "00000000:")
        name = f"| {g:>3}  {c.product}"
        power = f"| N/A   {rng.randrange(28, 40)}C    P0"
        usage = f"{rng.randrange(60, 120)}W / {watts:>4}W |"
        out += [f"{name}{'On  |':>{43 - len(name)}}   {bus}.0 Off |                    0 |",
                f"{power}{usage:>{43 - len(power)}}       1MiB / {mib:>6}MiB |      0%      Default |",
                "|                                         |                        |             Disabled |",
                "+-----------------------------------------+------------------------+----------------------+"]
    out += ["", "+-----------------------------------------------------------------------------------------+",
            "| Processes:                                                                              |",
            "|  GPU   GI   CI        PID   Type   Process name                              GPU Memory |",
            "|        ID   ID                                                               Usage      |",
            "|=========================================================================================|",
            "|  No running processes found                                                             |",
            "+-----------------------------------------------------------------------------------------+"]
    return out


def _urllib3_retry(job: Job) -> str:
    rng = job.rng
    bucket = rng.choice(_BUCKETS)
    path = f"/{job.run_name.split('-')[0]}/train/shard-{rng.randrange(100000):06d}.tar"
    broken = rng.choice((
        "'ProtocolError('Connection aborted.', ConnectionResetError(104, 'Connection reset by peer'))'",
        f"'ReadTimeoutError(\"HTTPSConnectionPool(host='{bucket}.s3.us-east-1.amazonaws.com', port=443): Read timed "
        "out. (read timeout=60)\")'",
    ))
    total = rng.randint(2, 4)
    return (f"WARNING:urllib3.connectionpool:Retrying (Retry(total={total}, connect=None, read=None, redirect=None, "
            f"status=None)) after connection broken by {broken}: {path}")


def _openmpi_openib(job: Job, burst: Burst, t: float) -> None:
    c = job.cluster
    host = c.hosts[0]
    rule = "-" * 74
    block = [rule, "By default, for Open MPI 4.0 and later, infiniband ports on a device",
             "are not used by default.  The intent is to use UCX for these devices.",
             "You can override this policy by setting the btl_openib_allow_ib MCA parameter", "to true.", "",
             f"  Local host:              {host}", "  Local adapter:           mlx5_0", "  Local port:              1",
             "", rule, rule, "WARNING: There was an error initializing an OpenFabrics device.", "",
             f"  Local host:   {host}", "  Local device: mlx5_0", rule]
    for i, line in enumerate(block):
        burst.add(t + 0.0001 * i, line)
    pid = c.agent_pids[0]
    n = c.world_size - 1
    burst.add(t + 2.0, f"[{host}:{pid:05d}] {n} more processes have sent help message help-mpi-btl-openib.txt / ib port "
                       "not selected")
    burst.add(t + 2.0, f"[{host}:{pid:05d}] Set MCA parameter \"orte_base_help_aggregate\" to 0 to see all help / error "
                       "messages")
    burst.add(t + 2.0, f"[{host}:{pid:05d}] {n} more processes have sent help message help-mpi-btl-openib.txt / error in "
                       "device init")


def _error_words(job: Job, burst: Burst) -> None:
    """Names and settings with "error" and "nan" in them, printed once by rank 0."""
    p = job.rank_proc(burst, 0, job.rank_time(0) + 1.0)
    rng = job.rng
    mix = rng.choice(("c4_en=0.55, stack_dedup=0.25, grammar_error_correction=0.1, arxiv=0.1",
                      "fineweb_edu=0.7, code_errors_fixed=0.1, wiki=0.2",
                      "slimpajama=0.8, asr_error_transcripts=0.05, books=0.15"))
    p.say(f"{job.clock.py(p.t)} - INFO - data.py:51 - dataset mixture: {mix}")
    p.say(f"{job.clock.py(p.t)} - INFO - data.py:58 - loader: num_workers=8, prefetch_factor=4, on_error='skip', "
          f"max_bad_samples={rng.choice((100, 1000))}, errors_so_far=0, nan_check=False")


def _batch_size_finder(job: Job, burst: Burst) -> None:
    rng = job.rng
    p = job.rank_proc(burst, 0, job.rank_time(0) + 2.0)
    ok = rng.choice((8, 16, 32))
    bs = 2
    while bs <= ok:
        p.say("`Trainer.fit` stopped: `max_steps=3` reached.", rng.uniform(5, 20))
        p.say(f"Batch size {bs} succeeded, trying batch size {bs * 2}")
        bs *= 2
    p.say(f"Batch size {bs} failed, trying batch size {ok}", rng.uniform(3, 10))
    p.say(f"Finished batch size finder, will continue with full run using batch size {ok}")
    ckpt = f"/ckpt/{job.run_name}/.scale_batch_size_{uuid.UUID(int=rng.getrandbits(128))}.ckpt"
    p.say(f"Restoring states from the checkpoint path at {ckpt}")
    p.say(f"Restored all states from the checkpoint at {ckpt}", 1.0)


def _deprecations(job: Job, burst: Burst) -> None:
    """The warnings every rank prints once at its first steps."""
    rng = job.rng
    lib = job.lib
    reentrant = rng.random() < 0.6
    ddp = job.flavour.name in ("plain", "lightning", "hf") and rng.random() < 0.7
    where = "reducer.cpp:1389"
    for rank in range(job.cluster.world_size):
        p = job.rank_proc(burst, rank, job.rank_time(rank) + 5.0 + rng.random())
        if reentrant:
            p.say(f"{lib}/torch/utils/checkpoint.py:464: UserWarning: torch.utils.checkpoint: the use_reentrant "
                  "parameter should be passed explicitly. In version 2.4 we will raise an exception if use_reentrant "
                  "is not passed. use_reentrant=False is recommended, but if you need to preserve the current default "
                  "behavior, you can pass use_reentrant=True. Refer to docs for more details on the differences "
                  "between the two variants.")
            p.say("  warnings.warn(", 0.0001)
        if ddp:
            p.say(job.c10("W", p.tick(0.5), where) + "Warning: find_unused_parameters=True was specified in DDP "
                  "constructor, but did not find any unused parameters in the forward pass. This flag results in an "
                  "extra traversal of the autograd graph every iteration,  which can adversely affect performance. If "
                  "your model indeed never has any unused parameters in the forward pass, consider turning this flag "
                  "off. Note that this warning may be a false positive if your model has flow control causing later "
                  "iterations to have unused parameters. (function operator())")


def new_realism(job: Job, steps: int, exclude: frozenset[str] = frozenset()) -> Realism:
    """Draw a profile for ``job`` and attach it (see ``Realism.draw``)."""
    profile = Realism.draw(job, steps=steps, exclude=exclude)
    profile.attach(job)
    return profile
