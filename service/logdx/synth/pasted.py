"""Short pasted excerpts that end in a fatal exception: what a user pastes into a ticket.

    from logdx.synth.pasted import pasted_excerpt, pasted_set
    truth = pasted_excerpt(out, seed=3, crash="out_of_memory", framework="hf", style="rank", order="crash_first")

A few to a few dozen lines, the last words of one process: an uncaught exception with its traceback (or a
C++ abort, or a process saying it aborts), with nothing after it that shows the job going on. Around it,
what such a paste holds: some of the framework's start-up lines, before the crash or (pasted in the wrong
order, ``order="crash_first"``) after it, or none (``order="alone"``). A third of them carry a misleading
exit code 0 (``exit_code=0`` in the truth: the job ran as ``python train.py 2>&1 | tee train.log``, whose
status is tee's); a process's own last words outrank it.

Crashes (``crash``), each as the interpreter, torch or the process prints it:
    ``bad_syntax``      a SyntaxError / IndentationError at import: in an imported module (a traceback), or in
                        the main script (Python prints no ``Traceback`` header then, only the file, the code and
                        the caret); the 3.10+ messages (``expected ':'``, ``unmatched ')'``...).
    ``missing_module``  ``ModuleNotFoundError: No module named 'utils.data_utils'`` (the user's own package).
    ``out_of_memory``   ``torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate ...`` (torch >= 2.2's
                        wording, "this process has ... memory in use") or torch 1.x's ``RuntimeError: CUDA out of
                        memory. ... (GPU 0; ... total capacity; ...)``.
    ``illegal_memory``  ``RuntimeError: CUDA error: an illegal memory access was encountered`` and torch's three
                        lines after it (c10/cuda/CUDAException.cpp), or the same from C++: ``terminate called
                        after throwing an instance of 'c10::Error'`` / ``what():`` / torch's ``Exception raised
                        from c10_cuda_check_implementation`` frames / the shell's ``Aborted (core dumped)``.
    ``missing_key``     ``KeyError: 'input_ids'`` raised in the user's collate function.
    ``missing_file``    ``FileNotFoundError: [Errno 2] No such file or directory: ...`` opening the user's data.
    ``none_attribute``  ``AttributeError: 'NoneType' object has no attribute 'size'`` in the user's forward.
    ``nan_abort``       the training loop's own check: the loss turns NaN and the script prints ``NaN detected in
                        loss, aborting.`` (logdx issue 28) and exits.
Frameworks (``framework``): a plain ``train.py`` loop, the HF Trainer, Lightning, DeepSpeed, Megatron-LM: their
entry frames and start-up lines (the Trainer's ``***** Running training *****`` block and ``Loading checkpoint
shards`` bar, DeepSpeed's ``[real_accelerator.py:203:get_accelerator]``, Lightning's ``GPU available`` lines and
sanity-check bar, Megatron's ``> initializing torch distributed ...``, torchrun's OMP_NUM_THREADS banner and the
``datasets`` ``Map:`` bars). Bars are progress-shaped lines: pasted after the crash, they must not read as the
job going on. Styles (``style``): bare, torch >= 2.4's ``[rank0]:``,
``torchrun --tee``'s ``[default0]:``, ``srun -l``'s ``0: ``, ``kubectl logs --timestamps``' RFC 3339 stamps;
with ``launcher_box`` torchrun's ChildFailedError summary follows the traceback (its launcher's echo).

Label (``JobTruth``, kind ``pasted``): status ``failed``, the crash's category / failure type / action from the
taxonomy's definitions (DESIGN.md): a syntax error, a missing module of the user's own, a KeyError, a missing
file or an AttributeError raised in the user's code is the script's; a CUDA out-of-memory the framework's (lower
the batch size); a NaN loss the framework's ``nan_loss``; an illegal memory access ``illegal_memory``
(infrastructure, restart). ``root_line_nos``: the exception line (for the C++ abort also its ``what():`` line;
for the NaN abort the first NaN loss line and the abort line).
"""

from __future__ import annotations

from dataclasses import dataclass
from random import Random
from typing import TextIO

from logdx.model import FT, Action, Category
from logdx.synth.clock import Clock
from logdx.synth.job import Frame, traceback_lines
from logdx.synth.longjob import GeneratedCase, JobTruth

CRASHES = ("bad_syntax", "missing_module", "out_of_memory", "illegal_memory", "missing_key", "missing_file", "none_attribute",
           "nan_abort")
FRAMEWORKS = ("plain", "hf", "lightning", "deepspeed", "megatron")
STYLES = ("bare", "rank", "tee", "srun", "kubectl")
ORDERS = ("startup_first", "crash_first", "alone")

_LABELS: dict[str, tuple[Category, str, Action]] = {
    "bad_syntax": (Category.SCRIPT, FT.SYNTAX_ERROR, Action.NO_RESTART),
    "missing_module": (Category.SCRIPT, FT.IMPORT_ERROR, Action.NO_RESTART),
    "out_of_memory": (Category.FRAMEWORK, FT.CUDA_OOM, Action.NO_RESTART),
    "illegal_memory": (Category.INFRASTRUCTURE, FT.CUDA_ERROR, Action.RESTART),
    "missing_key": (Category.SCRIPT, FT.KEY_ERROR, Action.NO_RESTART),
    "missing_file": (Category.SCRIPT, FT.FILE_NOT_FOUND, Action.NO_RESTART),
    "none_attribute": (Category.SCRIPT, FT.ATTRIBUTE_ERROR, Action.NO_RESTART),
    "nan_abort": (Category.FRAMEWORK, FT.NAN_LOSS, Action.NO_RESTART),
}
_USERS = ("alice", "bwang", "researcher", "ml", "jdoe")
_PROJECTS = ("llm-finetune", "gpt-pretrain", "vision-ssl", "speech", "rlhf")


@dataclass(slots=True)
class _Crash:
    """A crash as printed, and which of its lines are a right root line."""

    lines: list[str]
    roots: list[int]  # indices into lines


@dataclass(slots=True)
class _Context:
    rng: Random
    framework: str
    root: str  # the user's project directory
    lib: str  # site-packages
    t: float  # wall clock of the paste's first line

    @property
    def entry(self) -> str:
        return {"megatron": f"{self.root}/pretrain_gpt.py", "hf": f"{self.root}/finetune.py"}.get(
            self.framework, f"{self.root}/train.py")


# -- the frames that lead from the entry script to the user's training step, per framework --------------


def _loop_frames(c: _Context) -> list[Frame]:
    lib = c.lib
    match c.framework:
        case "hf":
            hf = f"{lib}/transformers/trainer.py"
            return [(c.entry, 311, "<module>", "main()"), (c.entry, 297, "main", "trainer.train()"),
                    (hf, 1938, "train", "return inner_training_loop("),
                    (hf, 2279, "_inner_training_loop", "tr_loss_step = self.training_step(model, inputs)"),
                    (hf, 3318, "training_step", "loss = self.compute_loss(model, inputs)"),
                    (hf, 3363, "compute_loss", "outputs = model(**inputs)")]
        case "lightning":
            pl = f"{lib}/lightning/pytorch"
            return [(c.entry, 64, "<module>", "trainer.fit(model, datamodule=dm)"),
                    (f"{pl}/trainer/trainer.py", 538, "fit", "call._call_and_handle_interrupt("),
                    (f"{pl}/trainer/call.py", 47, "_call_and_handle_interrupt", "return trainer_fn(*args, **kwargs)"),
                    (f"{pl}/trainer/trainer.py", 574, "_fit_impl", "self._run(model, ckpt_path=ckpt_path)"),
                    (f"{pl}/loops/fit_loop.py", 205, "run", "self.advance()"),
                    (f"{pl}/loops/training_epoch_loop.py", 250, "advance", "batch_output = self.automatic_optimization.run(trainer.optimizers[0], batch_idx, kwargs)")]
        case "deepspeed":
            return [(c.entry, 402, "<module>", "main()"), (c.entry, 371, "main", "loss = model_engine(batch)"),
                    (f"{lib}/deepspeed/utils/nvtx.py", 15, "wrapped_fn", "ret_val = func(*args, **kwargs)"),
                    (f"{lib}/deepspeed/runtime/engine.py", 1846, "forward", "loss = self.module(*inputs, **kwargs)")]
        case "megatron":
            mt = f"{c.root}/megatron/training/training.py"
            return [(c.entry, 228, "<module>", "pretrain("), (mt, 349, "pretrain", "iteration, num_floating_point_operations_so_far = train("),
                    (mt, 1264, "train", "train_step(forward_step_func,"),
                    (mt, 730, "train_step", "losses_reduced = forward_backward_func(")]
    return [(c.entry, 140, "<module>", "main(args)"), (c.entry, 121, "main", "loss = train_one_epoch(model, loader, optimizer, epoch)"),
            (c.entry, 77, "train_one_epoch", "out = model(batch)")]


def _module_call(c: _Context) -> list[Frame]:
    nn = f"{c.lib}/torch/nn/modules/module.py"
    return [(nn, 1736, "_wrapped_call_impl", "return self._call_impl(*args, **kwargs)"),
            (nn, 1747, "_call_impl", "return forward_call(*args, **kwargs)")]


# -- the crashes ------------------------------------------------------------------------------------------


def _bad_syntax(c: _Context) -> _Crash:
    rng = c.rng
    code, caret, message = rng.choice((
        ("    def forward(self, x)", "                        ^", "SyntaxError: expected ':'"),
        ('    print(f"step {step} loss {loss:.4f")', "                                       ^",
         "SyntaxError: f-string: expecting '}'"),
        ("        return torch.cat([h, x], dim=-1))", "                                        ^",
         "SyntaxError: unmatched ')'"),
        ("      self.proj = nn.Linear(dim, dim)", "    ^", "IndentationError: unexpected indent"),
    ))
    if rng.random() < 0.5:  # the main script itself: no traceback header
        line_no = rng.randrange(20, 400)
        return _Crash([f'  File "{c.entry}", line {line_no}', code, caret, message], [3])
    module = f"{c.root}/models/{rng.choice(('transformer', 'encoder', 'lora', 'heads'))}.py"
    frames: list[Frame] = [(c.entry, rng.randrange(3, 30), "<module>", "from models import build_model"),
                           (f"{c.root}/models/__init__.py", 2, "<module>", "from .transformer import build_model")]
    lines = traceback_lines(frames, f'  File "{module}", line {rng.randrange(10, 300)}\n{code}\n{caret}\n{message}')
    return _Crash(lines, [len(lines) - 1])


def _missing_module(c: _Context) -> _Crash:
    frames: list[Frame] = [(c.entry, c.rng.randrange(3, 30), "<module>", "from utils.data_utils import build_dataset")]
    lines = traceback_lines(frames, "ModuleNotFoundError: No module named 'utils.data_utils'")
    return _Crash(lines, [len(lines) - 1])


def _out_of_memory(c: _Context) -> _Crash:
    rng = c.rng
    frames = _loop_frames(c) + _module_call(c) + [
        (f"{c.root}/models/attention.py", 118, "forward", "scores = torch.matmul(q, k.transpose(-2, -1)) / self.scale")]
    want = rng.choice((1.95, 2.00, 4.00, 768.0 / 1024, 10.25))
    if rng.random() < 0.6:
        total = rng.choice((79.15, 39.39, 23.65))
        used = total - rng.uniform(0.3, 1.5)
        message = (f"torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate {want:.2f} GiB. GPU 0 has a total "
                   f"capacity of {total:.2f} GiB of which {total - used:.2f} GiB is free. Including non-PyTorch memory, "
                   f"this process has {used:.2f} GiB memory in use. Of the allocated memory {used - 3.1:.2f} GiB is "
                   "allocated by PyTorch, and 2.89 GiB is reserved by PyTorch but unallocated. If reserved but "
                   "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
                   "fragmentation.  See documentation for Memory Management  "
                   "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")
    else:
        message = (f"RuntimeError: CUDA out of memory. Tried to allocate {want * 1024:.2f} MiB (GPU 0; 15.78 GiB total "
                   "capacity; 14.21 GiB already allocated; 3.44 MiB free; 14.51 GiB reserved in total by PyTorch) If "
                   "reserved memory is >> allocated memory try setting max_split_size_mb to avoid fragmentation.  See "
                   "documentation for Memory Management and PYTORCH_CUDA_ALLOC_CONF")
    lines = traceback_lines(frames, message)
    return _Crash(lines, [len(lines) - 1])


_CUDA_TAIL = ["CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below "
              "might be incorrect.", "For debugging consider passing CUDA_LAUNCH_BLOCKING=1",
              "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions."]


def _illegal_memory(c: _Context) -> _Crash:
    what = "CUDA error: an illegal memory access was encountered"
    if c.rng.random() < 0.6:
        frames = _loop_frames(c) + [(f"{c.lib}/torch/_tensor.py", 581, "backward", "torch.autograd.backward("),
                                    (f"{c.lib}/torch/autograd/__init__.py", 347, "backward", "_engine_run_backward(")]
        lines = traceback_lines(frames, f"RuntimeError: {what}")
        root = len(lines) - 1
        return _Crash(lines + _CUDA_TAIL, [root])
    so = f"{c.lib}/torch/lib"
    lines = ["terminate called after throwing an instance of 'c10::Error'", f"  what():  {what}", *_CUDA_TAIL, "",
             "Exception raised from c10_cuda_check_implementation at ../c10/cuda/CUDAException.cpp:43 (most recent call first):",
             f"frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x57 (0x7f3b2c4a1617 in {so}/libc10.so)",
             "frame #1: c10::detail::torchCheckFail(char const*, char const*, unsigned int, std::string const&) + 0x64 "
             f"(0x7f3b2c45c98d in {so}/libc10.so)",
             "frame #2: c10::cuda::c10_cuda_check_implementation(int, char const*, char const*, int, bool) + 0x118 "
             f"(0x7f3b2c56e9f8 in {so}/libc10_cuda.so)",
             f"frame #3: <unknown function> + 0x1d7c7 (0x7f3b2c53c7c7 in {so}/libc10_cuda.so)",
             "Aborted (core dumped)"]
    return _Crash(lines, [0, 1])


def _missing_key(c: _Context) -> _Crash:
    dl = f"{c.lib}/torch/utils/data"
    frames = _loop_frames(c)[:2] + [
        (f"{dl}/dataloader.py", 701, "__next__", "data = self._next_data()"),
        (f"{dl}/dataloader.py", 757, "_next_data", "data = self._dataset_fetcher.fetch(index)  # may raise StopIteration"),
        (f"{dl}/_utils/fetch.py", 55, "fetch", "return self.collate_fn(data)"),
        (f"{c.root}/data/collate.py", 41, "collate_batch", 'ids = [ex["input_ids"] for ex in examples]'),
        (f"{c.root}/data/collate.py", 41, "<listcomp>", 'ids = [ex["input_ids"] for ex in examples]')]
    lines = traceback_lines(frames, "KeyError: 'input_ids'")
    return _Crash(lines, [len(lines) - 1])


def _missing_file(c: _Context) -> _Crash:
    path = f"/data/{c.root.rsplit('/', 1)[-1]}/{c.rng.choice(('train.jsonl', 'shards/part-00000.parquet', 'val.json'))}"
    frames: list[Frame] = [(c.entry, 190, "<module>", "main()"), (c.entry, 152, "main", "train_set = load_examples(args.train_file)"),
                           (f"{c.root}/data/io.py", 23, "load_examples", "with open(path) as f:")]
    lines = traceback_lines(frames, f"FileNotFoundError: [Errno 2] No such file or directory: '{path}'")
    return _Crash(lines, [len(lines) - 1])


def _none_attribute(c: _Context) -> _Crash:
    frames = _loop_frames(c) + _module_call(c) + [
        (f"{c.root}/models/model.py", 87, "forward", "bsz, seq_len = attention_mask.size()")]
    lines = traceback_lines(frames, "AttributeError: 'NoneType' object has no attribute 'size'")
    return _Crash(lines, [len(lines) - 1])


def _nan_abort(c: _Context) -> _Crash:
    rng = c.rng
    step, loss = rng.randrange(10, 200) * 10, rng.uniform(2.0, 3.5)
    lines = []
    for _ in range(rng.randrange(3, 8)):
        lines.append(f"step {step} | loss = {loss:.4f} | lr {3e-4:.1e} | {rng.uniform(280, 320):.1f} ms/step")
        step, loss = step + 10, loss * rng.uniform(0.97, 1.0)
    lines.append(f"step {step} | loss = nan | lr {3e-4:.1e} | {rng.uniform(280, 320):.1f} ms/step")
    lines.append("NaN detected in loss, aborting.")
    return _Crash(lines, [len(lines) - 2, len(lines) - 1])


_WRITERS = {"bad_syntax": _bad_syntax, "missing_module": _missing_module, "out_of_memory": _out_of_memory, "illegal_memory": _illegal_memory,
            "missing_key": _missing_key, "missing_file": _missing_file, "none_attribute": _none_attribute,
            "nan_abort": _nan_abort}


# -- the start-up lines around it -------------------------------------------------------------------------


def _startup(c: _Context, clock: Clock) -> list[str]:
    rng, t = c.rng, c.t
    py = clock.py
    match c.framework:
        case "hf":
            return [f"[INFO|trainer.py:2134] {py(t)} >> ***** Running training *****",
                    f"[INFO|trainer.py:2135] {py(t)} >>   Num examples = {rng.randrange(10, 90) * 1000:,}",
                    f"[INFO|trainer.py:2136] {py(t)} >>   Num Epochs = 3",
                    f"[INFO|trainer.py:2137] {py(t)} >>   Instantaneous batch size per device = {rng.choice((2, 4, 8))}",
                    f"[INFO|trainer.py:2141] {py(t)} >>   Total optimization steps = {rng.randrange(1000, 9000):,}",
                    "Loading checkpoint shards: 100%|██████████| 2/2 [00:05<00:00,  2.61s/it]"]
        case "lightning":
            return ["GPU available: True (cuda), used: True", "TPU available: False, using: 0 TPU cores",
                    "HPU available: False, using: 0 HPUs", "LOCAL_RANK: 0 - CUDA_VISIBLE_DEVICES: [0,1,2,3]",
                    "  | Name  | Type        | Params", "0 | model | Transformer | 124 M",
                    "Sanity Checking DataLoader 0: 100%|██████████| 2/2 [00:01<00:00,  1.71it/s]"]
        case "deepspeed":
            return [f"[{py(t)}] [INFO] [real_accelerator.py:203:get_accelerator] Setting ds_accelerator to cuda (auto detect)",
                    f"[{py(t + 2)}] [INFO] [comm.py:637:init_distributed] cdb=None",
                    f"[{py(t + 2)}] [INFO] [comm.py:668:init_distributed] Initializing TorchBackend in DeepSpeed with backend nccl",
                    f"[{py(t + 9)}] [INFO] [logging.py:96:log_dist] [Rank 0] DeepSpeed info: version=0.14.4, git-hash=unknown, git-branch=unknown"]
        case "megatron":
            return ["using world size: 8, data-parallel size: 8, context-parallel size: 1, tensor-model-parallel size: 1",
                    "> building GPT2BPETokenizer tokenizer ...", "> initializing torch distributed ...",
                    "> initialized tensor model parallel with size 1", "> compiling dataset index builder ..."]
    return ["W0501 10:00:00.123000 140234 torch/distributed/run.py:779] ",
            "W0501 10:00:00.123000 140234 torch/distributed/run.py:779] *****************************************",
            "W0501 10:00:00.123000 140234 torch/distributed/run.py:779] Setting OMP_NUM_THREADS environment variable for "
            "each process to be 1 in default, to avoid your system being overloaded, please further tune the variable for "
            "optimal performance in your application as needed.",
            f"{py(t + 3)} - INFO - __main__ - loading model and tokenizer",
            f"Map:  50%|█████     | {rng.randrange(20, 40)}000/{rng.randrange(50, 90)}000 [00:06<00:06, 4213.18 examples/s]",
            "Map: 100%|██████████| 90000/90000 [00:12<00:00, 4102.77 examples/s]"]


def _launcher_box(c: _Context, clock: Clock, t: float) -> list[str]:
    """torchrun's summary after a worker died: the launcher's echo of the crash."""
    return ["Traceback (most recent call last):",
            '  File "/usr/local/bin/torchrun", line 8, in <module>', "    sys.exit(main())",
            f'  File "{c.lib}/torch/distributed/run.py", line 143, in __call__', "    raise ChildFailedError(",
            "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
            "============================================================", f"{c.entry} FAILED",
            "------------------------------------------------------------", "Failures:", "  <NO_OTHER_FAILURES>",
            "------------------------------------------------------------", "Root Cause (first observed failure):",
            "[0]:", f"  time      : {clock.underscored(t)}", "  host      : gpu-node-01", "  rank      : 0 (local_rank: 0)",
            f"  exitcode  : 1 (pid: {c.rng.randrange(2000, 99999)})", "  error_file: <N/A>",
            "  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html",
            "============================================================"]


def _prefix(style: str, clock: Clock, t: float) -> str:
    match style:
        case "rank":
            return "[rank0]: "
        case "tee":
            return "[default0]:"
        case "srun":
            return "0: "
        case "kubectl":
            return f"{clock.iso(t)}.{int((t % 1) * 1e9):09d}Z "
    return ""


def pasted_excerpt(out: TextIO, *, seed: int, crash: str, framework: str, style: str, order: str,
                   exit_code: int | None = None, launcher_box: bool = False) -> JobTruth:
    """Write one pasted excerpt to ``out`` (see the module docstring) and return its truth."""
    if crash not in _WRITERS or framework not in FRAMEWORKS or style not in STYLES or order not in ORDERS:
        raise ValueError(f"unknown crash/framework/style/order: {crash}/{framework}/{style}/{order}")
    rng = Random(f"logdx-pasted:{seed}")
    user, project = rng.choice(_USERS), rng.choice(_PROJECTS)
    c = _Context(rng=rng, framework=framework, root=f"/home/{user}/{project}",
                 lib=rng.choice(("/usr/local/lib/python3.10/dist-packages", f"/home/{user}/miniconda3/envs/train/lib/python3.11/site-packages")),
                 t=1714557600.0 + rng.randrange(0, 30 * 86400))
    clock = Clock()
    crash_lines = _WRITERS[crash](c)
    startup = _startup(c, clock) if order != "alone" else []
    box = _launcher_box(c, clock, c.t + 30) if launcher_box else []
    body = crash_lines.lines + box
    lines, first_crash = (startup + body, len(startup)) if order != "crash_first" else (body + startup, 0)
    t = c.t
    written = []
    for text in lines:
        t += rng.uniform(0.0, 0.05)
        written.append(_prefix(style, clock, t) + text)
    out.write("\n".join(written) + "\n")
    category, failure_type, action = _LABELS[crash]
    roots = [first_crash + i + 1 for i in crash_lines.roots]
    return JobTruth(kind="pasted", status="failed", category=category, failure_type=failure_type, action=action,
                    exit_code=exit_code, root_line_nos=roots, root_line=written[roots[0] - 1], lines_written=len(written),
                    seed=seed, style=style, flavour=framework, ranks=1,
                    variant={"crash": crash, "order": order, "launcher_box": launcher_box})


def pasted_set(n: int = 48, seed: int = 0) -> list[GeneratedCase]:
    """``n`` pasted excerpts: every crash on every framework in turn, the styles and orders varied, one in three
    with a misleading exit code 0, one in six of the torchrun-launched with the launcher's summary after it."""
    rng = Random(f"logdx-pasted-set:{seed}")
    out = []
    for i in range(n):
        crash = CRASHES[i % len(CRASHES)]
        framework = FRAMEWORKS[(i // len(CRASHES) + i) % len(FRAMEWORKS)]
        style = STYLES[(i * 3 + i // 5) % len(STYLES)]
        order = ORDERS[(i + i // len(ORDERS)) % len(ORDERS)]
        kw = {"seed": rng.randrange(1 << 30), "crash": crash, "framework": framework, "style": style, "order": order,
              "exit_code": 0 if i % 3 == 2 else None,
              "launcher_box": style in ("rank", "tee") and crash != "bad_syntax" and i % 6 == 1}
        out.append(GeneratedCase(f"pasted-{i:02d}-{crash}-{framework}-{style}-{order}", pasted_excerpt, kw))
    return out
