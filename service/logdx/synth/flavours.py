"""What the training framework prints: banners, config dumps, progress, checkpoints, evaluation.

A flavour knows its own formats and code paths (for tracebacks); it never decides what fails.
Hot path: ``rank_line`` and ``summary`` run once per rank per log step (millions of times), so
they use plain f-strings over precomputed pieces and one ``random()`` call or two.

Flavours: ``megatron`` (NGC container, ``dist-packages``), ``deepspeed`` (HF Trainer + DeepSpeed,
conda), ``fsdp`` (a torchtitan-style FSDP2 script, sometimes with ANSI colours), ``lightning``,
and ``plain`` (a hand-written torchrun loop that logs on every rank).
"""

from __future__ import annotations

import math
from random import Random

from logdx.synth.cluster import Cluster
from logdx.synth.job import USER_ROOT, Flavour, Frame, Job
from logdx.synth.sink import Burst


class Megatron(Flavour):
    name = "megatron"
    names_hosts = False
    entry = "/workspace/Megatron-LM/pretrain_gpt.py"
    lib = "/usr/local/lib/python3.10/dist-packages"  # NGC containers install into dist-packages
    python = "/usr/bin/python"
    carets = False
    iters_per_step = 10
    collectives_per_iteration = 2

    def __init__(self, rng: Random, cluster: Cluster) -> None:
        super().__init__(rng, cluster)
        world = cluster.world_size
        self.tp = min(cluster.gpus_per_host, world, 8)
        self.dp = max(1, world // self.tp)
        self.gbs = rng.choice((256, 512, 1024, 2048))
        self.tflops = rng.uniform(150.0, 420.0)
        self.mm = "/workspace/Megatron-LM/megatron"

    def log_rank(self) -> int:
        return self.cluster.world_size - 1  # Megatron logs progress from the last pipeline stage

    def rank_line(self, job: Job, rank: int, t: float) -> str:
        a = self.mem_base[rank] * 1000 + 300 * self.rng.random()
        return (
            f"[Rank {rank}] (after {job.iteration} iterations) memory (MB) | allocated: {a:.2f} | "
            f"max allocated: {a * 1.61:.2f} | reserved: {a * 1.74:.2f} | max reserved: {a * 1.74:.2f}"
        )

    def summary(self, job: Job, t: float) -> list[str]:
        it = job.iteration
        nan_iters = job.flavour.iters_per_step if job.nan else job.nan_iters
        return [
            f" [{job.clock.seconds(t)}] iteration {it:>8d}/{self.train_iters:>8d} | consumed samples: "
            f"{it * self.gbs:>12d} | elapsed time per iteration (ms): {job.step_ms:.1f} | throughput per GPU "
            f"(TFLOP/s/GPU): {self.tflops * 1000 / job.step_ms * self.step_ms / 1000:.1f} | learning rate: "
            f"{job.lr:.6E} | global batch size: {self.gbs:>5d} | lm loss: {job.loss:.6E} | loss scale: "
            f"{job.loss_scale:.1f} | grad norm: {job.grad_norm:.3f} | number of skipped iterations: "
            f"{job.skipped_iters:>3d} | number of nan iterations: {nan_iters:>3d} |"
        ]

    def banner(self, job: Job, burst: Burst) -> None:
        c = self.cluster
        p = self.proc(job, burst, 0, 0.5)
        p.say(f"using world size: {c.world_size}, data-parallel size: {self.dp}, context-parallel size: 1, "
              f"tensor-model-parallel size: {self.tp}, pipeline-model-parallel size: 1 ")
        p.say(f"using torch.{'float16' if self.fp16 else 'bfloat16'} for parameters ...")
        p.say("------------------------ arguments ------------------------")
        args = {
            "accumulate_allreduce_grads_in_fp32": "True", "adam_beta1": "0.9", "adam_beta2": "0.95",
            "attention_dropout": "0.0", "bf16": str(not self.fp16), "check_for_nan_in_loss_and_grad": "True",
            "clip_grad": "1.0", "data_path": "['/data/pile/pile_text_document']",
            "distributed_backend": "nccl", "distributed_timeout_minutes": str(job.nccl_timeout_ms // 60000),
            "eval_interval": str(job.eval_every * self.iters_per_step), "eval_iters": "10",
            "exit_duration_in_mins": "None", "exit_interval": "None", "exit_on_missing_checkpoint": "False",
            "exit_signal_handler": "False", "ffn_hidden_size": "20480", "global_batch_size": str(self.gbs),
            "hidden_size": "5120", "load": f"/ckpt/{job.run_name}", "log_interval": str(self.iters_per_step),
            "lr": "0.0003", "lr_decay_style": "cosine", "lr_warmup_iters": "2000", "micro_batch_size": "1",
            "no_persist_layer_norm": "False", "num_attention_heads": "40", "num_layers": "40",
            "overlap_grad_reduce": "True", "pipeline_model_parallel_size": "1",
            "save": f"/ckpt/{job.run_name}", "save_interval": str(job.ckpt_every * self.iters_per_step),
            "seq_length": "4096", "tensor_model_parallel_size": str(self.tp),
            "tokenizer_type": "GPT2BPETokenizer", "train_iters": str(self.train_iters),
            "use_distributed_optimizer": "True", "world_size": str(c.world_size),
        }
        if self.fp16:
            args.update({"fp16": "True", "initial_loss_scale": "4294967296", "loss_scale": "None",
                         "loss_scale_window": "1000"})
        for key, value in sorted(args.items()) if self.fp16 else args.items():
            p.say(f"  {key} {'.' * max(2, 48 - len(key))} {value}", 0.0001)
        p.say("-------------------- end of arguments ---------------------")
        p.say(f"setting number of micro-batches to constant {self.gbs // self.dp}")
        p.say("> building GPT2BPETokenizer tokenizer ...")
        p.say(" > padded vocab (size: 50257) with 943 dummy tokens (new size: 51200)")
        p.say("> initializing torch distributed ...")
        p.say(f"> initialized tensor model parallel with size {self.tp}")
        p.say("> initialized pipeline model parallel with size 1")
        p.say("> setting random seeds to 1234 ...")
        p.say("> compiling dataset index builder ...")
        p.say(f">>> done with dataset index builder. Compilation time: {self.rng.uniform(0.03, 0.2):.3f} seconds", 0.1)
        p.say("> compiling and loading fused kernels ...")
        p.say(f">>> done with compiling and loading fused kernels. Compilation time: {self.rng.uniform(1, 9):.3f} seconds", 3.0)
        p.say(f"time to initialize megatron (seconds): {self.rng.uniform(9, 60):.3f}")
        p.say(f"[after megatron is initialized] datetime: {job.clock.seconds(p.t)} ")
        p.say("building GPT model ...")
        for rank in range(min(self.tp, c.world_size)):
            q = self.proc(job, burst, rank, 3.0)
            q.say(f" > number of parameters on (tensor, pipeline) model parallel rank ({rank}, 0): 1623728128")
        p.say("> learning rate decay style: cosine", 3.0)
        if job.start_iteration:
            p.say(f" loading checkpoint from /ckpt/{job.run_name} at iteration {job.start_iteration}", 0.1)
            p.say(f" successfully loaded checkpoint from /ckpt/{job.run_name} [ t 1/{self.tp}, p 1/1 ] at iteration "
                  f"{job.start_iteration}", 20.0)
        p.say(f"[after model, optimizer, and learning rate scheduler are built] datetime: {job.clock.seconds(p.t)} ")
        p.say("> building train, validation, and test datasets ...")
        p.say(" > datasets target sizes (minimum size):")
        p.say(f"    train:      {self.train_iters * self.gbs}")
        p.say(f"    validation: {self.train_iters // 100 * self.gbs}")
        p.say("    test:       10240")
        p.say("> finished creating GPT datasets ...", 2.0)
        p.say(f"[after dataloaders are built] datetime: {job.clock.seconds(p.t)} ")
        p.say("done with setup ...")
        p.say("training ...")
        p.say(f"[before the start of training step] datetime: {job.clock.seconds(p.t)} ")

    def checkpoint(self, job: Job, burst: Burst, complete: bool = True) -> None:
        p = self.proc(job, burst, 0, 0.2)
        it = job.iteration
        p.say(f"saving checkpoint at iteration {it:>8d} to /ckpt/{job.run_name}")
        if complete:
            secs = self.rng.uniform(8, 60)
            p.say(f"  successfully saved checkpoint at iteration {it:>8d} to /ckpt/{job.run_name}", secs)
            p.say("(min, max) time across ranks (ms):")
            p.say(f"    save-checkpoint ................................: ({secs * 1000:.2f}, {secs * 1000 + 3.1:.2f})")

    def evaluate(self, job: Job, burst: Burst) -> None:
        p = self.proc(job, burst, self.log_rank(), 10.0)
        v = job.loss - 0.04
        rule = "-" * 97
        p.say(rule)
        p.say(f" validation loss at iteration {job.iteration} | lm loss value: {v:.6E} | lm loss PPL: "
              f"{math.exp(min(v, 50)):.6E} | ")
        p.say(rule)

    def finish(self, job: Job, burst: Burst) -> None:
        p = self.proc(job, burst, 0, 0.5)
        p.say(f"[after training is done] datetime: {job.clock.seconds(p.t)} ")
        p.say(f"saving checkpoint at iteration {job.iteration:>8d} to /ckpt/{job.run_name}")
        p.say(f"  successfully saved checkpoint at iteration {job.iteration:>8d} to /ckpt/{job.run_name}", 30.0)
        q = self.proc(job, burst, self.log_rank(), 40.0)
        v = job.loss - 0.04
        for split in ("validation", "test"):
            q.say("-" * 97)
            q.say(f" {split} loss at iteration {job.iteration} on {split} set | lm loss value: {v:.6E} | "
                  f"lm loss PPL: {math.exp(min(v, 50)):.6E} | ", 10.0)
            q.say("-" * 97)

    def nan_exception(self, job: Job, rank: int) -> tuple[list[Frame], str]:
        c = self.cluster
        frames = self.loop_frames() + [
            (f"{self.mm}/core/pipeline_parallel/schedules.py", 468, "forward_backward_no_pipelining",
             "config.finalize_model_grads_func([model])"),
            (f"{self.mm}/core/distributed/finalize_model_grads.py", 109, "finalize_model_grads", "model_chunk.finish_grad_sync()"),
            (f"{self.mm}/core/distributed/distributed_data_parallel.py", 285, "finish_grad_sync", "buffer.finish_grad_sync()"),
            (f"{self.mm}/core/distributed/param_and_grad_buffer.py", 150, "finish_grad_sync", "self.start_grad_sync()"),
            (f"{self.mm}/core/distributed/param_and_grad_buffer.py", 119, "start_grad_sync", "assert not norm.isnan(), ("),
        ]
        return frames, (
            f"AssertionError: Rank {rank}: found NaN in local grad norm in backward pass before data-parallel "
            f"communication collective. Device: {c.local_rank(rank)}, node: {c.host(rank)}"
        )

    def loop_frames(self) -> list[Frame]:
        return [
            (self.entry, 243, "<module>", "pretrain("),
            (f"{self.mm}/training/training.py", 349, "pretrain", "iteration, num_floating_point_operations_so_far = train("),
            (f"{self.mm}/training/training.py", 1255, "train", "train_step(forward_step_func,"),
            (f"{self.mm}/training/training.py", 718, "train_step", "losses_reduced = forward_backward_func("),
        ]

    def forward_frames(self) -> list[Frame]:
        return [
            (f"{self.mm}/core/pipeline_parallel/schedules.py", 452, "forward_backward_no_pipelining", "output_tensor, num_tokens = forward_step("),
            (f"{self.mm}/core/pipeline_parallel/schedules.py", 274, "forward_step", "output_tensor, loss_func = forward_step_func(data_iterator, model)"),
            (self.entry, 160, "forward_step", "output_tensor = model(tokens, position_ids, attention_mask,"),
            *self.module_call_frames(),
            (f"{self.mm}/core/models/gpt/gpt_model.py", 242, "forward", "hidden_states = self.decoder("),
            *self.module_call_frames(),
            (f"{self.mm}/core/transformer/transformer_block.py", 493, "forward", "hidden_states, context = layer("),
            *self.module_call_frames(),
            (f"{self.mm}/core/transformer/transformer_layer.py", 303, "forward", "mlp_output_with_bias = self.mlp(pre_mlp_layernorm_output)"),
            *self.module_call_frames(),
            (f"{self.mm}/core/transformer/mlp.py", 118, "forward", "intermediate_parallel = self.activation_func(intermediate_parallel)"),
            (f"{self.lib}/torch/nn/functional.py", 1704, "gelu", "return torch._C._nn.gelu(input, approximate=approximate)"),
        ]

    def data_frames(self) -> list[Frame]:
        return [
            (f"{self.mm}/core/pipeline_parallel/schedules.py", 274, "forward_step", "output_tensor, loss_func = forward_step_func(data_iterator, model)"),
            (self.entry, 151, "forward_step", "tokens, labels, loss_mask, attention_mask, position_ids = get_batch("),
            (self.entry, 84, "get_batch", "batch = get_batch_on_this_tp_rank(data_iterator)"),
            (f"{self.mm}/training/utils.py", 296, "get_batch_on_this_tp_rank", "data = next(data_iterator)"),
            (f"{self.lib}/torch/utils/data/dataloader.py", 701, "__next__", "data = self._next_data()"),
        ]

    def save_frames(self) -> list[Frame]:
        return [
            (f"{self.mm}/training/training.py", 1342, "train", "save_checkpoint_and_time(iteration, model, optimizer,"),
            (f"{self.mm}/training/training.py", 1010, "save_checkpoint_and_time", "save_checkpoint(iteration, model, optimizer, opt_param_scheduler,"),
            (f"{self.mm}/training/checkpointing.py", 398, "save_checkpoint", "torch.save(state_dict, checkpoint_name)"),
        ]

    def save_stack(self) -> list[Frame]:
        return self.loop_frames()[:2] + self.save_frames()

    def user_call_frames(self, call: str) -> list[Frame]:
        return self.loop_frames() + [
            (f"{self.mm}/core/pipeline_parallel/schedules.py", 452, "forward_backward_no_pipelining", "output_tensor, num_tokens = forward_step("),
            (f"{self.mm}/core/pipeline_parallel/schedules.py", 274, "forward_step", "output_tensor, loss_func = forward_step_func(data_iterator, model)"),
            (self.entry, 151, "forward_step", call),
        ]

    def library_attribute_error(self) -> tuple[list[Frame], str]:
        te = f"{self.lib}/transformer_engine/pytorch/module"
        frames = self.loop_frames() + self.forward_frames()[:-2] + [
            (f"{self.mm}/core/transformer/mlp.py", 98, "forward", "intermediate_parallel, bias_parallel = self.linear_fc1(hidden_states)"),
            *self.module_call_frames(),
            (f"{te}/layernorm_linear.py", 1209, "forward", "with self.prepare_forward(inp, is_first_microbatch) as inp:"),
            ("/usr/lib/python3.10/contextlib.py", 135, "__enter__", "return next(self.gen)"),
            (f"{te}/base.py", 598, "prepare_forward", 'if self.fp8_meta["recipe"].amax_history_len > 0:'),
        ]
        return frames, "AttributeError: 'NoneType' object has no attribute 'amax_history_len'"


class DeepSpeed(Flavour):
    name = "deepspeed"
    names_hosts = False
    lib = "/opt/conda/lib/python3.10/site-packages"
    python = "/opt/conda/bin/python"
    carets = False
    iters_per_step = 10  # steps_per_print / logging_steps

    def __init__(self, rng: Random, cluster: Cluster) -> None:
        super().__init__(rng, cluster)
        self.samples_per_sec = rng.uniform(8.0, 90.0)
        self.stage = rng.choice((1, 2, 3))

    def ds(self, job: Job, t: float, where: str, message: str, level: str = "INFO") -> str:
        return f"[{job.clock.py(t)}] [{level}] [{where}] {message}"

    def rank_line(self, job: Job, rank: int, t: float) -> str:
        cur = self.samples_per_sec * (0.95 + 0.1 * self.rng.random())
        m = self.mem_base[rank] * 0.5
        it = job.iteration
        return (
            f"[{job.clock.py(t)}] [INFO] [timer.py:260:stop] epoch=0/micro_step={it * 8}/global_step={it}, "
            f"RunningAvgSamplesPerSec={self.samples_per_sec:.2f}, CurrSamplesPerSec={cur:.2f}, "
            f"MemAllocated={m:.1f}GB, MaxMemAllocated={m * 1.7:.1f}GB"
        )

    def summary(self, job: Job, t: float) -> list[str]:
        loss = "nan" if job.nan else f"{job.loss:.4f}"
        gn = "nan" if job.nan else f"{job.grad_norm:.4f}"
        return [
            self.ds(job, t, "logging.py:96:log_dist",
                    f"[Rank 0] step={job.iteration}, skipped={job.skipped_total}, lr=[{job.lr:.8f}], mom=[(0.9, 0.95)]"),
            f"{{'loss': {loss}, 'grad_norm': {gn}, 'learning_rate': {job.lr:.8f}, "
            f"'epoch': {job.iteration / self.train_iters:.2f}}}",
        ]

    def banner(self, job: Job, burst: Burst) -> None:
        for rank in range(self.cluster.world_size):
            p = self.proc(job, burst, rank, 0.3)
            p.say(self.ds(job, p.t, "real_accelerator.py:203:get_accelerator", "Setting ds_accelerator to cuda (auto detect)"))
            p.say(self.ds(job, p.t, "comm.py:637:init_distributed", "cdb=None"), 0.5)
        p = self.proc(job, burst, 0, 1.5)
        p.say(self.ds(job, p.t, "comm.py:668:init_distributed", "Initializing TorchBackend in DeepSpeed with backend nccl"))
        p.say(self.ds(job, p.t, "logging.py:96:log_dist", "[Rank 0] DeepSpeed info: version=0.14.4, git-hash=unknown, git-branch=unknown"), 4.0)
        p.say(self.ds(job, p.t, "config.py:1000:print", "DeepSpeedEngine configuration:"))
        config = {
            "amp_enabled": "False", "bfloat16_enabled": str(not self.fp16), "checkpoint_parallel_write_pipeline": "False",
            "checkpoint_tag_validation_enabled": "True", "checkpoint_tag_validation_fail": "False",
            "communication_data_type": "None", "dump_state": "False", "fp16_auto_cast": "None",
            "fp16_enabled": str(self.fp16), "global_rank": "0", "gradient_accumulation_steps": "8",
            "gradient_clipping": "1.0", "load_universal_checkpoint": "False", "prescale_gradients": "False",
            "steps_per_print": str(self.iters_per_step), "train_batch_size": str(8 * self.cluster.world_size),
            "wall_clock_breakdown": "False", "world_size": str(self.cluster.world_size),
            "zero_allow_untested_optimizer": "True", "zero_enabled": "True", "zero_optimization_stage": str(self.stage),
        }
        for key, value in config.items():
            p.say(self.ds(job, p.t, "config.py:1004:print", f"  {key} {'.' * max(2, 30 - len(key))} {value}"), 0.0002)
        precision = ('"fp16": {"enabled": true, "loss_scale": 0, "initial_scale_power": 16}' if self.fp16
                     else '"bf16": {"enabled": true}')
        p.say(self.ds(job, p.t, "config.py:990:print_user_config", '  json = {"train_micro_batch_size_per_gpu": 1, '
                      f'"gradient_accumulation_steps": 8, "zero_optimization": {{"stage": {self.stage}}}, '
                      f'{precision}, "gradient_clipping": 1.0, "steps_per_print": 10}}'))
        p.say("***** Running training *****", 2.0)
        p.say(f"  Num examples = {self.train_iters * 8 * self.cluster.world_size:,}")
        p.say(f"  Total optimization steps = {self.train_iters:,}")

    def checkpoint(self, job: Job, burst: Burst, complete: bool = True) -> None:
        tag = f"global_step{job.iteration}"
        base = f"/ckpt/{job.run_name}/checkpoint-{job.iteration}/{tag}"
        p0 = self.proc(job, burst, 0, 0.2)
        p0.say(self.ds(job, p0.t, "logging.py:96:log_dist", f"[Rank 0] [Torch] Checkpoint {tag} is about to be saved!"))
        p0.say(self.ds(job, p0.t, "logging.py:96:log_dist", f"[Rank 0] Saving model checkpoint: {base}/mp_rank_00_model_states.pt"))
        for rank in range(self.cluster.world_size):
            p = self.proc(job, burst, rank, 0.4)
            shard = f"{base}/bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
            p.say(self.ds(job, p.t, "torch_checkpoint_engine.py:21:save", f"[Torch] Saving {shard}..."))
            if complete:
                p.say(self.ds(job, p.t, "torch_checkpoint_engine.py:23:save", f"[Torch] Saved {shard}."), 6.0)
                p.say(self.ds(job, p.t, "engine.py:3536:_save_zero_checkpoint", f"zero checkpoint saved {shard}"), 0.01)
                p.say(self.ds(job, p.t, "torch_checkpoint_engine.py:33:commit", f"[Torch] Checkpoint {tag} is ready now!"), 0.01)

    def evaluate(self, job: Job, burst: Burst) -> None:
        p = self.proc(job, burst, 0, 20.0)
        p.say(f"{{'eval_loss': {job.loss - 0.04:.4f}, 'eval_runtime': {self.rng.uniform(20, 90):.4f}, "
              f"'eval_samples_per_second': {self.rng.uniform(50, 300):.3f}, 'eval_steps_per_second': "
              f"{self.rng.uniform(0.5, 3):.3f}, 'epoch': {job.iteration / self.train_iters:.2f}}}")

    def finish(self, job: Job, burst: Burst) -> None:
        p = self.proc(job, burst, 0, 0.5)
        p.say(f"{{'train_runtime': {self.rng.uniform(1e4, 1e5):.4f}, 'train_samples_per_second': "
              f"{self.samples_per_sec:.3f}, 'train_steps_per_second': 0.052, 'train_loss': {job.loss + 0.3:.4f}, "
              "'epoch': 1.0}")
        p.say(f"Training completed. Saving model to /ckpt/{job.run_name}/final", 0.1)

    def nan_lines(self, job: Job, burst: Burst) -> None:
        p = self.proc(job, burst, 0, 0.1)
        scale = 2 ** max(0, 16 - job.step % 17)
        p.say(self.ds(job, p.t, "loss_scaler.py:183:update_scale",
                      f"[deepspeed] OVERFLOW! Rank 0 Skipping step. Attempted loss scale: {scale}, reducing to {max(1, scale // 2)}"))

    def nan_exception(self, job: Job, rank: int) -> tuple[list[Frame], str]:
        ds = f"{self.lib}/deepspeed"
        frames = self.loop_frames() + [
            (f"{self.lib}/transformers/trainer.py", 2474, "_inner_training_loop", "self.optimizer.step()"),
            (f"{self.lib}/accelerate/optimizer.py", 159, "step", "self.optimizer.step(closure)"),
            (f"{ds}/runtime/engine.py", 2213, "step", "self._take_model_step(lr_kwargs)"),
            (f"{ds}/runtime/engine.py", 2119, "_take_model_step", "self.optimizer.step()"),
            (f"{ds}/runtime/zero/stage_1_and_2.py", 1862, "step", "self._update_scale(self.overflow)"),
            (f"{ds}/runtime/zero/stage_1_and_2.py", 2108, "_update_scale", "self.loss_scaler.update_scale(has_overflow)"),
            (f"{ds}/runtime/fp16/loss_scaler.py", 175, "update_scale", "raise Exception("),
        ]
        return frames, "Exception: Current loss scale already at minimum - cannot decrease scale anymore. Exiting run."

    def loop_frames(self) -> list[Frame]:
        return [
            (self.entry, 318, "<module>", "main()"),
            (self.entry, 297, "main", "trainer.train(resume_from_checkpoint=args.resume)"),
            (f"{self.lib}/transformers/trainer.py", 1938, "train", "return inner_training_loop("),
        ]

    def forward_frames(self) -> list[Frame]:
        hf = f"{self.lib}/transformers/models/llama/modeling_llama.py"
        return [
            (f"{self.lib}/transformers/trainer.py", 2279, "_inner_training_loop", "tr_loss_step = self.training_step(model, inputs)"),
            (f"{self.lib}/transformers/trainer.py", 3318, "training_step", "loss = self.compute_loss(model, inputs)"),
            (f"{self.lib}/transformers/trainer.py", 3363, "compute_loss", "outputs = model(**inputs)"),
            *self.module_call_frames(),
            (f"{self.lib}/deepspeed/utils/nvtx.py", 15, "wrapped_fn", "ret_val = func(*args, **kwargs)"),
            (f"{self.lib}/deepspeed/runtime/engine.py", 1846, "forward", "loss = self.module(*inputs, **kwargs)"),
            *self.module_call_frames(),
            (hf, 1189, "forward", "outputs = self.model("),
            *self.module_call_frames(),
            (hf, 1001, "forward", "layer_outputs = decoder_layer("),
            *self.module_call_frames(),
            (hf, 734, "forward", "hidden_states, self_attn_weights, present_key_value = self.self_attn("),
            *self.module_call_frames(),
            (hf, 360, "forward", "attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)"),
            (f"{self.lib}/torch/nn/functional.py", 1885, "softmax", "ret = input.softmax(dim, dtype=dtype)"),
        ]

    def data_frames(self) -> list[Frame]:
        return [
            (f"{self.lib}/transformers/trainer.py", 2230, "_inner_training_loop", "for step, inputs in enumerate(epoch_iterator):"),
            (f"{self.lib}/accelerate/data_loader.py", 454, "__iter__", "current_batch = next(dataloader_iter)"),
            (f"{self.lib}/torch/utils/data/dataloader.py", 701, "__next__", "data = self._next_data()"),
        ]

    def save_frames(self) -> list[Frame]:
        ds = f"{self.lib}/deepspeed"
        return [
            (f"{self.lib}/transformers/trainer.py", 2341, "_inner_training_loop", "self._maybe_log_save_evaluate(tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval)"),
            (f"{self.lib}/transformers/trainer.py", 2807, "_maybe_log_save_evaluate", "self._save_checkpoint(model, trial, metrics=metrics)"),
            (f"{self.lib}/transformers/trainer.py", 2886, "_save_checkpoint", "self.model_wrapped.save_checkpoint(output_dir)"),
            (f"{ds}/runtime/engine.py", 3150, "save_checkpoint", "self._save_zero_checkpoint(save_dir, tag)"),
            (f"{ds}/runtime/engine.py", 3535, "_save_zero_checkpoint", "self.checkpoint_engine.save(zero_sd, zero_checkpoint_name)"),
            (f"{ds}/runtime/checkpoint_engine/torch_checkpoint_engine.py", 22, "save", "torch.save(state_dict, path)"),
        ]

    def save_stack(self) -> list[Frame]:
        return self.loop_frames() + self.save_frames()

    def user_call_frames(self, call: str) -> list[Frame]:
        return self.loop_frames() + [
            (f"{self.lib}/transformers/trainer.py", 2279, "_inner_training_loop", "tr_loss_step = self.training_step(model, inputs)"),
            (f"{self.lib}/transformers/trainer.py", 3318, "training_step", "loss = self.compute_loss(model, inputs)"),
            (self.entry, 142, "compute_loss", call),
        ]

    def library_attribute_error(self) -> tuple[list[Frame], str]:
        ds = f"{self.lib}/deepspeed"
        frames = self.loop_frames() + [
            (f"{self.lib}/transformers/trainer.py", 2474, "_inner_training_loop", "self.optimizer.step()"),
            (f"{self.lib}/accelerate/optimizer.py", 159, "step", "self.optimizer.step(closure)"),
            (f"{ds}/runtime/engine.py", 2213, "step", "self._take_model_step(lr_kwargs)"),
            (f"{ds}/runtime/engine.py", 2119, "_take_model_step", "self.optimizer.step()"),
            (f"{ds}/runtime/zero/stage_1_and_2.py", 1904, "step", "self._optimizer_step(i)"),
            (f"{ds}/runtime/zero/stage_1_and_2.py", 1794, "_optimizer_step", "self.optimizer.step()"),
            (f"{self.lib}/torch/optim/optimizer.py", 484, "wrapper", "out = func(*args, **kwargs)"),
            (f"{ds}/ops/adam/fused_adam.py", 146, "step", "if p.grad.data.is_sparse:"),
        ]
        return frames, "AttributeError: 'NoneType' object has no attribute 'data'"


class FSDP(Flavour):
    """A torchtitan-style FSDP2 loop: every rank logs its own step line."""

    name = "fsdp"
    names_hosts = False
    entry = f"{USER_ROOT}/train_fsdp.py"
    lib = "/opt/venv/lib/python3.11/site-packages"
    python = "/opt/venv/bin/python"
    collectives_per_iteration = 130  # FSDP: an all-gather and a reduce-scatter per block

    def __init__(self, rng: Random, cluster: Cluster) -> None:
        super().__init__(rng, cluster)
        self.color = rng.random() < 0.5  # torchtitan colours its metrics unless told not to
        self.mfu = rng.uniform(30.0, 60.0)
        self.capacity = float(cluster.capacity_gib)

    def titan(self, job: Job, t: float, message: str) -> str:
        return f"[titan] {job.clock.py(t)} - root - INFO - {message}"

    def rank_line(self, job: Job, rank: int, t: float) -> str:
        mem = self.mem_base[rank] * (1.0 + 0.01 * self.rng.random())
        tps = self.tokens_per_rank * 1000.0 / job.step_ms
        loss = f"{job.loss:7.4f}"
        if self.color:
            return (
                f"[titan] {job.clock.py(t)} - root - INFO - \x1b[31mstep: {job.iteration:2d}  \x1b[32mloss: {loss}  "
                f"\x1b[33mmemory: {mem:5.2f}GiB({mem / self.capacity * 100:.2f}%)  \x1b[34mtps: {tps:,.0f}  "
                f"\x1b[36mtflops: {self.mfu * 9.89:,.2f}  \x1b[35mmfu: {self.mfu:.2f}%\x1b[39m"
            )
        return (
            f"[titan] {job.clock.py(t)} - root - INFO - step: {job.iteration:2d}  loss: {loss}  memory: "
            f"{mem:5.2f}GiB({mem / self.capacity * 100:.2f}%)  tps: {tps:,.0f}  tflops: {self.mfu * 9.89:,.2f}  "
            f"mfu: {self.mfu:.2f}%"
        )

    def summary(self, job: Job, t: float) -> list[str]:
        return []

    def banner(self, job: Job, burst: Burst) -> None:
        c = self.cluster
        for rank in range(c.world_size):
            p = self.proc(job, burst, rank, 0.3)
            for message in (
                "Starting job: Llama 3 8B training",
                f"Building 1-D device mesh with ['dp_shard'], [{c.world_size}]",
                "[GC] Initial GC collection. 0.00 seconds.",
                f"CUDA capacity: {c.product} with {c.capacity_gib}GiB memory",
                "Building llama3 8B with ModelArgs(_enforced='This field is used to enforce all fields have "
                "defaults.', dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, "
                "norm_eps=1e-05, rope_theta=500000, max_seq_len=8192)",
                "Model llama3 8B size: 8,030,261,248 total parameters",
                "Applied selective activation checkpointing to the model",
                "Applied FSDP to the model",
                f"CUDA memory usage for model: 3.77GiB({377 / float(c.capacity_gib):.2f}%)",
                f"Training starts at step {job.start_iteration + 1}, with local batch size 2, global batch size "
                f"{2 * c.world_size}, sequence length 8192, total steps {self.train_iters} (warmup 200)",
            ):
                p.say(self.titan(job, p.t, message), 0.3)

    def checkpoint(self, job: Job, burst: Burst, complete: bool = True) -> None:
        secs = self.rng.uniform(3, 30)
        for rank in range(self.cluster.world_size):
            p = self.proc(job, burst, rank, 0.2)
            p.say(self.titan(job, p.t, f"Saving the checkpoint (or staging if async is enabled) to "
                                       f"/ckpt/{job.run_name}/step-{job.iteration}."))
            if complete:
                p.say(self.titan(job, p.t, f"[GC] GC collection invoked by checkpointer. {self.rng.uniform(0, 0.1):.2f} seconds."), 0.2)
                p.say(self.titan(job, p.t, f"Finished saving the checkpoint (or staging if async is enabled)in {secs:.2f} seconds."), secs)

    def evaluate(self, job: Job, burst: Burst) -> None:
        p = self.proc(job, burst, 0, 15.0)
        p.say(self.titan(job, p.t, f"validate step: {job.iteration}  loss: {job.loss - 0.04:7.4f}  (512 batches, 0 errors)"))

    def finish(self, job: Job, burst: Burst) -> None:
        for rank in range(self.cluster.world_size):
            p = self.proc(job, burst, rank, 0.5)
            p.say(self.titan(job, p.t, "Sleeping 2 seconds for other ranks to complete"))
            p.say(self.titan(job, p.t, "Training completed"), 2.0)
            p.say(self.titan(job, p.t, "Process group destroyed."), 0.1)

    def forward_frames(self) -> list[Frame]:
        model = f"{USER_ROOT}/project/models/llama.py"
        return [
            (self.entry, 171, "train_step", "pred = model(input_ids)"),
            *self.module_call_frames(),
            (f"{self.lib}/torch/distributed/fsdp/_fully_shard/_fully_shard.py", 468, "__call__", "return super().__call__(*args, **kwargs)"),
            *self.module_call_frames(),
            (model, 447, "forward", "h = layer(h, self.freqs_cis)"),
            *self.module_call_frames(),
            (model, 325, "forward", "out = h + self.feed_forward(self.ffn_norm(h))"),
            *self.module_call_frames(),
            (model, 258, "forward", "return self.w2(F.silu(self.w1(x)) * self.w3(x))"),
            (f"{self.lib}/torch/nn/functional.py", 2380, "silu", "return torch._C._nn.silu(input)"),
        ]


class Lightning(Flavour):
    name = "lightning"
    names_hosts = False
    entry = f"{USER_ROOT}/lit_train.py"
    lib = "/opt/conda/envs/train/lib/python3.11/site-packages"
    python = "/opt/conda/envs/train/bin/python"
    iters_per_step = 50  # log_every_n_steps

    def __init__(self, rng: Random, cluster: Cluster) -> None:
        super().__init__(rng, cluster)
        self.steps_per_epoch = rng.choice((2000, 2667, 5000, 12000))
        self.best = math.inf
        self.version = rng.randrange(0, 40)

    def rank_line(self, job: Job, rank: int, t: float) -> str:
        loss = job.loss + 0.02 * (self.rng.random() - 0.5)
        return (
            f"{job.clock.py(t)} INFO  [lit_module.py:144] rank={rank} step={job.iteration} train_loss={loss:.4f} "
            f"lr={job.lr:.3e} grad_norm={job.grad_norm:.3f} it/s={1000 / job.step_ms:.2f}"
        )

    def summary(self, job: Job, t: float) -> list[str]:
        it = job.iteration
        n = self.steps_per_epoch
        done = it % n
        pct = done * 100 // n
        eighths = done * 80 // n
        bar = "█" * (eighths // 8) + (" ▏▎▍▌▋▊▉"[eighths % 8] if eighths < 80 else "")
        ips = 1000 / job.step_ms
        return [
            f"Epoch {it // n}:  {pct:>2d}%|{bar:<10}| {done}/{n} [{_tqdm_time(done / ips)}<{_tqdm_time((n - done) / ips)}, "
            f"{ips:.2f}it/s, v_num={self.version}, train_loss={job.loss:.3f}]"
        ]

    def banner(self, job: Job, burst: Burst) -> None:
        c = self.cluster
        p0 = self.proc(job, burst, 0, 0.2)
        for line in ("GPU available: True (cuda), used: True", "TPU available: False, using: 0 TPU cores",
                     "HPU available: False, using: 0 HPUs"):
            p0.say(line)
        for rank in range(c.world_size):
            p = self.proc(job, burst, rank, 0.5)
            p.say(f"Initializing distributed: GLOBAL_RANK: {rank}, MEMBER: {rank + 1}/{c.world_size}")
        p0.say("-" * 100, 2.0)
        p0.say("distributed_backend=nccl")
        p0.say(f"All distributed processes registered. Starting with {c.world_size} processes")
        p0.say("-" * 100)
        for rank in range(c.world_size):
            p = self.proc(job, burst, rank, 2.5)
            p.say(f"LOCAL_RANK: {c.local_rank(rank)} - CUDA_VISIBLE_DEVICES: [{','.join(map(str, range(c.gpus_per_host)))}]")
        for line in ("", "  | Name  | Type | Params | Mode ", "---------------------------------------",
                     "0 | model | GPT  | 1.3 B  | train", "---------------------------------------",
                     "1.3 B     Trainable params", "0         Non-trainable params", "1.3 B     Total params",
                     "5,261.484 Total estimated model params size (MB)", "0         Modules in eval mode"):
            p0.say(line, 0.001)

    def checkpoint(self, job: Job, burst: Burst, complete: bool = True) -> None:
        p = self.proc(job, burst, 0, 0.2)
        it = job.iteration
        epoch = it // self.steps_per_epoch
        val = job.loss - 0.04
        if val < self.best or not complete:
            self.best = min(self.best, val)
            p.say(f"Epoch {epoch}, global step {it}: 'val_loss' reached {val:.5f} (best {self.best:.5f}), saving "
                  f"model to '/ckpt/{job.run_name}/epoch={epoch}-step={it}.ckpt' as top 3")
        else:
            p.say(f"Epoch {epoch}, global step {it}: 'val_loss' was not in top 3")

    def evaluate(self, job: Job, burst: Burst) -> None:
        p = self.proc(job, burst, 0, 12.0)
        p.say(f"Validation DataLoader 0: 100%|██████████| 64/64 [00:12<00:00,  {self.rng.uniform(4, 6):.2f}it/s]")

    def finish(self, job: Job, burst: Burst) -> None:
        p = self.proc(job, burst, 0, 0.5)
        p.say(f"`Trainer.fit` stopped: `max_steps={job.iteration}` reached.")

    def nan_exception(self, job: Job, rank: int) -> tuple[list[Frame], str]:
        pl = f"{self.lib}/lightning/pytorch"
        frames = self.loop_frames() + [
            (f"{pl}/core/module.py", 1100, "backward", "loss.backward(*args, **kwargs)"),
            (f"{self.lib}/torch/_tensor.py", 581, "backward", "torch.autograd.backward("),
            (f"{self.lib}/torch/autograd/__init__.py", 347, "backward", "_engine_run_backward("),
            (f"{self.lib}/torch/autograd/graph.py", 825, "_engine_run_backward",
             "return Variable._execution_engine.run_backward(  # Calls into the C++ engine to run the backward pass"),
        ]
        return frames, "RuntimeError: Function 'LogSoftmaxBackward0' returned nan values in its 0th output."

    def loop_frames(self) -> list[Frame]:
        pl = f"{self.lib}/lightning/pytorch"
        return [
            (self.entry, 88, "<module>", "trainer.fit(model, datamodule=dm, ckpt_path='last')"),
            (f"{pl}/trainer/trainer.py", 538, "fit", "call._call_and_handle_interrupt("),
            (f"{pl}/trainer/call.py", 46, "_call_and_handle_interrupt", "return trainer.strategy.launcher.launch(trainer_fn, *args, trainer=trainer, **kwargs)"),
            (f"{pl}/strategies/launchers/subprocess_script.py", 105, "launch", "return function(*args, **kwargs)"),
            (f"{pl}/trainer/trainer.py", 574, "_fit_impl", "self._run(model, ckpt_path=ckpt_path)"),
            (f"{pl}/trainer/trainer.py", 981, "_run", "results = self._run_stage()"),
            (f"{pl}/trainer/trainer.py", 1025, "_run_stage", "self.fit_loop.run()"),
            (f"{pl}/loops/fit_loop.py", 205, "run", "self.advance()"),
            (f"{pl}/loops/training_epoch_loop.py", 250, "advance", "batch_output = self.automatic_optimization.run(trainer.optimizers[0], batch_idx, kwargs)"),
        ]

    def forward_frames(self) -> list[Frame]:
        return [
            (f"{self.lib}/lightning/pytorch/loops/optimization/automatic.py", 319, "_training_step",
             'training_step_output = call._call_strategy_hook(trainer, "training_step", *kwargs.values())'),
            (f"{self.lib}/lightning/pytorch/strategies/ddp.py", 390, "training_step", "return self.model(*args, **kwargs)"),
            *self.module_call_frames(),
            (f"{USER_ROOT}/project/lit_module.py", 121, "training_step", "logits = self.model(batch['input_ids'])"),
            *self.module_call_frames(),
            (f"{USER_ROOT}/project/models/gpt.py", 97, "forward", "att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))"),
        ]

    @property
    def backward_call(self) -> Frame:
        return (f"{self.lib}/lightning/pytorch/core/module.py", 1100, "backward", "loss.backward(*args, **kwargs)")

    def save_stack(self) -> list[Frame]:
        pl = f"{self.lib}/lightning/pytorch"
        return self.loop_frames()[:7] + [
            (f"{pl}/loops/fit_loop.py", 207, "run", "self.on_advance_end()"),
            (f"{pl}/loops/fit_loop.py", 386, "on_advance_end",
             'call._call_callback_hooks(trainer, "on_train_epoch_end", monitoring_callbacks=True)'),
            (f"{pl}/trainer/call.py", 218, "_call_callback_hooks", "fn(trainer, trainer.lightning_module, *args, **kwargs)"),
            (f"{pl}/callbacks/model_checkpoint.py", 323, "on_train_epoch_end", "self._save_topk_checkpoint(trainer, monitor_candidates)"),
        ] + self.save_frames()

    def user_call_frames(self, call: str) -> list[Frame]:
        return self.loop_frames() + self.forward_frames()[:4] + [
            (f"{USER_ROOT}/project/lit_module.py", 126, "training_step", call),
        ]

    def save_frames(self) -> list[Frame]:
        pl = f"{self.lib}/lightning"
        return [
            (f"{pl}/pytorch/callbacks/model_checkpoint.py", 384, "_save_checkpoint", "trainer.save_checkpoint(filepath, self.save_weights_only)"),
            (f"{pl}/pytorch/trainer/trainer.py", 1365, "save_checkpoint", "self.strategy.save_checkpoint(checkpoint, filepath, storage_options=storage_options)"),
            (f"{pl}/fabric/plugins/io/torch_io.py", 58, "save_checkpoint", "_atomic_save(checkpoint, path)"),
            (f"{pl}/fabric/utilities/cloud_io.py", 89, "_atomic_save", "torch.save(checkpoint, bytesbuffer)"),
        ]


def _tqdm_time(seconds: float) -> str:
    """tqdm's 05:07 or 1:05:07."""
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def _tqdm_bar(done: int, total: int, width: int = 10) -> str:
    """tqdm's ``  3%|▎         |``: eighths of a block per cell."""
    eighths = done * width * 8 // max(1, total)
    full, part = divmod(min(eighths, width * 8), 8)
    return "█" * full + (" ▏▎▍▌▋▊▉"[part] if full < width else "") + " " * (width - full - (full < width))


class HFTrainer(Flavour):
    """The Hugging Face Trainer (accelerate / torchrun): only the main process reports, through tqdm
    and the Trainer's metrics dicts. Formats from transformers' trainer.py (``***** Running training
    *****``, ``{'loss': ..., 'grad_norm': ..., 'learning_rate': ..., 'epoch': ...}``, ``Training completed.
    Do not forget to share your model on huggingface.co/models =)``) as users paste them."""

    name = "hf"
    names_hosts = False
    entry = f"{USER_ROOT}/train_hf.py"
    lib = "/opt/conda/lib/python3.11/site-packages"
    python = "/opt/conda/bin/python"
    per_rank_lines = False
    collectives_per_iteration = 2

    def __init__(self, rng: Random, cluster: Cluster) -> None:
        super().__init__(rng, cluster)
        self.step_ms = rng.uniform(300.0, 3000.0)
        self.total = rng.choice((20000, 31250, 58590))
        self.logging_steps = rng.choice((5, 10, 25))
        self.carriage = rng.random() < 0.5  # tqdm's \r updates kept on one line, as a file captures them
        self.examples = self.total * 8 * cluster.world_size

    def rank_line(self, job: Job, rank: int, t: float) -> str:  # pragma: no cover - per_rank_lines is False
        return ""

    def _bar(self, job: Job, it: int) -> str:
        total = self.total + job.start_iteration  # a resumed run's max_steps lies beyond where it resumed
        done = min(it, total)
        secs = job.step_ms / 1000.0
        return (f"{done * 100 // total:3d}%|{_tqdm_bar(done, total)}| {done}/{total} "
                f"[{_tqdm_time(done * secs)}<{_tqdm_time((total - done) * secs)}, {secs:5.2f}s/it]")

    def summary(self, job: Job, t: float) -> list[str]:
        it = job.iteration
        bar = self._bar(job, it)
        if self.carriage and it > 1:
            bar = self._bar(job, it - 1) + "\r" + bar
        out = [bar]
        if it % self.logging_steps == 0:
            loss = "nan" if job.nan or math.isnan(job.loss) else f"{job.loss:.4f}"
            gn = "nan" if job.nan or math.isnan(job.grad_norm) else f"{job.grad_norm:.4f}"
            out.append(f"{{'loss': {loss}, 'grad_norm': {gn}, 'learning_rate': {job.lr:.4e}, "
                       f"'epoch': {it / self.total:.2f}}}")
        return out

    def banner(self, job: Job, burst: Burst) -> None:
        c = self.cluster
        p = self.proc(job, burst, 0, 1.0)
        p.say(f"{job.clock.py(p.t)} - INFO - __main__ - Training/evaluation parameters TrainingArguments(")
        for key, value in (("_n_gpu", "1"), ("bf16", "True"), ("dataloader_drop_last", "False"),
                           ("dataloader_num_workers", "8"), ("ddp_find_unused_parameters", "None"),
                           ("ddp_timeout", str(job.nccl_timeout_ms // 1000)), ("eval_strategy", "steps"),
                           ("gradient_accumulation_steps", "1"), ("gradient_checkpointing", "True"),
                           ("ignore_data_skip", "False"), ("learning_rate", "0.0003"), ("local_rank", "0"),
                           ("log_level", "info"), ("logging_nan_inf_filter", "True"),
                           ("logging_steps", str(self.logging_steps)), ("max_grad_norm", "1.0"),
                           ("max_steps", str(self.total)), ("output_dir", f"/ckpt/{job.run_name}"),
                           ("per_device_train_batch_size", "8"), ("save_safetensors", "True"),
                           ("save_steps", str(job.ckpt_every)), ("seed", "42"), ("skip_memory_metrics", "True"),
                           ("warmup_steps", "2000")):
            p.say(f"{key}={value},", 0.0001)
        p.say(")")
        p.say("***** Running training *****", 20.0)
        p.say(f"  Num examples = {self.examples:,}")
        p.say("  Num Epochs = 1")
        p.say("  Instantaneous batch size per device = 8")
        p.say(f"  Total train batch size (w. parallel, distributed & accumulation) = {8 * c.world_size:,}")
        p.say("  Gradient Accumulation steps = 1")
        p.say(f"  Total optimization steps = {self.total:,}")
        p.say("  Number of trainable parameters = 1,235,814,400")

    def checkpoint(self, job: Job, burst: Burst, complete: bool = True) -> None:
        p = self.proc(job, burst, 0, 0.2)
        out = f"/ckpt/{job.run_name}/checkpoint-{job.iteration}"
        p.say(f"Saving model checkpoint to {out}")
        if complete:
            p.say(f"Configuration saved in {out}/config.json", 0.5)
            p.say(f"Model weights saved in {out}/model.safetensors", self.rng.uniform(5, 30))
            p.say(f"tokenizer config file saved in {out}/tokenizer_config.json", 0.1)
            p.say(f"Special tokens file saved in {out}/special_tokens_map.json", 0.01)

    def evaluate(self, job: Job, burst: Burst) -> None:
        p = self.proc(job, burst, 0, 0.3)
        p.say("***** Running Evaluation *****")
        p.say("  Num examples = 4000")
        p.say("  Batch size = 8")
        runtime = self.rng.uniform(20, 90)
        p.say(f"{{'eval_loss': {job.loss - 0.04:.4f}, 'eval_runtime': {runtime:.4f}, 'eval_samples_per_second': "
              f"{4000 / runtime:.3f}, 'eval_steps_per_second': {500 / runtime:.3f}, "
              f"'epoch': {job.iteration / self.total:.2f}}}", runtime)

    def finish(self, job: Job, burst: Burst) -> None:
        p = self.proc(job, burst, 0, 0.5)
        p.say("")
        p.say("")
        p.say("Training completed. Do not forget to share your model on huggingface.co/models =)")
        p.say("")
        p.say("")
        runtime = job.iteration * job.step_ms / 1000.0
        p.say(f"{{'train_runtime': {runtime:.4f}, 'train_samples_per_second': {8 * self.cluster.world_size * 1000 / job.step_ms:.3f}, "
              f"'train_steps_per_second': {1000 / job.step_ms:.3f}, 'train_loss': {job.loss + 0.3:.4f}, "
              f"'epoch': {job.iteration / self.total:.2f}}}")
        p.say(f"Saving model checkpoint to /ckpt/{job.run_name}/final", 0.2)

    def loop_frames(self) -> list[Frame]:
        hf = f"{self.lib}/transformers/trainer.py"
        return [
            (self.entry, 201, "<module>", "main()"),
            (self.entry, 187, "main", "train_result = trainer.train(resume_from_checkpoint=checkpoint)"),
            (hf, 1938, "train", "return inner_training_loop("),
        ]

    def data_frames(self) -> list[Frame]:
        return [
            (f"{self.lib}/transformers/trainer.py", 2230, "_inner_training_loop", "for step, inputs in enumerate(epoch_iterator):"),
            (f"{self.lib}/accelerate/data_loader.py", 454, "__iter__", "current_batch = next(dataloader_iter)"),
            (f"{self.lib}/torch/utils/data/dataloader.py", 701, "__next__", "data = self._next_data()"),
        ]

    def user_call_frames(self, call: str) -> list[Frame]:
        """The user's Trainer subclass: its ``compute_loss`` override."""
        hf = f"{self.lib}/transformers/trainer.py"
        return self.loop_frames() + [
            (hf, 2279, "_inner_training_loop", "tr_loss_step = self.training_step(model, inputs)"),
            (hf, 3318, "training_step", "loss = self.compute_loss(model, inputs)"),
            (self.entry, 142, "compute_loss", call),
        ]


class NeMo(Flavour):
    """NeMo's Megatron GPT pre-training (Lightning underneath): ``[NeMo I <date> <module>:<line>]``
    lines and one progress bar on rank 0 (``Epoch 0: :  47%|████▋     | 7/15 [06:19<07:13,
    reduced_train_loss=11.50, global_step=5.000, consumed_samples=12288.0, train_step_timing in s=49.50]``,
    as in NVIDIA's and cloud vendors' published NeMo logs)."""

    name = "nemo"
    names_hosts = False
    entry = "/opt/NeMo/examples/nlp/language_modeling/megatron_gpt_pretraining.py"
    lib = "/usr/local/lib/python3.10/dist-packages"
    python = "/usr/bin/python"
    carets = False
    per_rank_lines = False
    collectives_per_iteration = 4

    def __init__(self, rng: Random, cluster: Cluster) -> None:
        super().__init__(rng, cluster)
        self.gbs = rng.choice((256, 512, 1024))
        self.max_steps = rng.choice((100000, 250000, 2000000))
        self.version = rng.randrange(100, 9999)

    def nemo(self, job: Job, t: float, level: str, where: str, message: str) -> str:
        return f"[NeMo {level} {job.clock.seconds(t)} {where}] {message}"

    def rank_line(self, job: Job, rank: int, t: float) -> str:  # pragma: no cover - per_rank_lines is False
        return ""

    def summary(self, job: Job, t: float) -> list[str]:
        it = job.iteration
        secs = job.step_ms / 1000.0
        loss = "nan" if job.nan or math.isnan(job.loss) else f"{job.loss:.3f}"
        done = it % 1000
        return [
            f"Epoch 0: : {done * 100 // 1000:3d}%|{_tqdm_bar(done, 1000)}| {it}/{self.max_steps} "
            f"[{_tqdm_time(it * secs)}<{_tqdm_time((self.max_steps - it) * secs)}, v_num={self.version}, "
            f"reduced_train_loss={loss}, global_step={it - 1}.0, consumed_samples={it * self.gbs:.1f}, "
            f"train_step_timing in s={secs:.2f}]"
        ]

    def banner(self, job: Job, burst: Burst) -> None:
        c = self.cluster
        p = self.proc(job, burst, 0, 0.5)
        p.say(self.nemo(job, p.t, "I", "exp_manager:396", f"Experiments will be logged at /results/{job.run_name}"))
        p.say(self.nemo(job, p.t, "I", "exp_manager:842", "TensorboardLogger has been set up"))
        p.say(self.nemo(job, p.t, "W", "exp_manager:931", "The checkpoint callback was told to monitor a validation "
                        f"value and trainer's max_steps was set to {self.max_steps}. Please ensure that max_steps "
                        "will run for at least 1 epochs to ensure that checkpointing will not error out."))
        for line in ("GPU available: True (cuda), used: True", "TPU available: False, using: 0 TPU cores",
                     "HPU available: False, using: 0 HPUs"):
            p.say(line)
        for rank in range(c.world_size):
            q = self.proc(job, burst, rank, 2.0)
            q.say(f"Initializing distributed: GLOBAL_RANK: {rank}, MEMBER: {rank + 1}/{c.world_size}")
            q.say(self.nemo(job, q.t, "I", "nemo_logging:393", f"Rank {rank} has data parallel group : "
                            f"[{', '.join(str(r) for r in range(rank % 8, c.world_size, 8))}]"), 3.0)
        p.say("-" * 100, 8.0)
        p.say("distributed_backend=nccl")
        p.say(f"All distributed processes registered. Starting with {c.world_size} processes")
        p.say("-" * 100)
        p.say(self.nemo(job, p.t, "I", "megatron_gpt_model:1568", "Pipeline model parallel rank: 0, Tensor model "
                        "parallel rank: 0, Number of model parameters on device: 1.56e+09. Number of precise model "
                        "parameters on device: 1.56e+09."), 20.0)
        p.say(self.nemo(job, p.t, "I", "modelPT:786", "Optimizer config = MegatronDistributedFusedAdam ("))
        p.say(self.nemo(job, p.t, "I", "lr_scheduler:923", 'Scheduler "<nemo.core.optim.lr_scheduler.CosineAnnealing '
                        f'object at 0x{self.rng.getrandbits(48):x}>" '))
        p.say("    will be used during training (effective maximum steps = "
              f"{self.max_steps}) - ")
        p.say("    Parameters : ")
        for line in ("    (warmup_steps: 500", "    constant_steps: 0", "    min_lr: 3.0e-05",
                     f"    max_steps: {self.max_steps}", "    )"):
            p.say(line, 0.0001)

    def checkpoint(self, job: Job, burst: Burst, complete: bool = True) -> None:
        p = self.proc(job, burst, 0, 0.2)
        val = job.loss - 0.04
        name = (f"/results/checkpoints/megatron_gpt--val_loss={val:.2f}-step={job.iteration}-consumed_samples="
                f"{job.iteration * self.gbs:.1f}.ckpt")
        p.say(f"Epoch 0, global step {job.iteration}: 'val_loss' reached {val:.5f} (best {val:.5f}), saving model to "
              f"'{name}' as top 10")
        if complete:
            old = job.iteration - job.ckpt_every * 10
            if old > 0:
                p.say(self.nemo(job, p.t, "I", "nlp_overrides:480", "Removing checkpoint: /results/checkpoints/"
                                f"megatron_gpt--val_loss={val + 0.3:.2f}-step={old}-consumed_samples="
                                f"{old * self.gbs:.1f}.ckpt"), self.rng.uniform(10, 60))

    def evaluate(self, job: Job, burst: Burst) -> None:
        p = self.proc(job, burst, 0, 15.0)
        p.say(f"Validation DataLoader 0: 100%|██████████| 32/32 [00:{self.rng.randrange(10, 59)}<00:00,  "
              f"{self.rng.uniform(0.5, 2.0):.2f}it/s]")

    def finish(self, job: Job, burst: Burst) -> None:
        p = self.proc(job, burst, 0, 0.5)
        p.say(f"`Trainer.fit` stopped: `max_steps={job.iteration}` reached.")

    def loop_frames(self) -> list[Frame]:
        pl = f"{self.lib}/lightning/pytorch"
        return [
            (self.entry, 42, "main", "trainer.fit(model)"),
            (f"{pl}/trainer/trainer.py", 538, "fit", "call._call_and_handle_interrupt("),
            (f"{pl}/trainer/call.py", 47, "_call_and_handle_interrupt", "return trainer_fn(*args, **kwargs)"),
            (f"{pl}/trainer/trainer.py", 574, "_fit_impl", "self._run(model, ckpt_path=ckpt_path)"),
            (f"{pl}/trainer/trainer.py", 981, "_run", "results = self._run_stage()"),
            (f"{pl}/trainer/trainer.py", 1025, "_run_stage", "self.fit_loop.run()"),
            (f"{pl}/loops/fit_loop.py", 205, "run", "self.advance()"),
            (f"{pl}/loops/training_epoch_loop.py", 250, "advance",
             "batch_output = self.automatic_optimization.run(trainer.optimizers[0], batch_idx, kwargs)"),
        ]

    def user_call_frames(self, call: str) -> list[Frame]:
        """The user's own Lightning callback, called at every batch."""
        pl = f"{self.lib}/lightning/pytorch"
        return self.loop_frames()[:-1] + [
            (f"{pl}/loops/training_epoch_loop.py", 226, "advance",
             'call._call_callback_hooks(trainer, "on_train_batch_start", batch, batch_idx)'),
            (f"{pl}/trainer/call.py", 218, "_call_callback_hooks", "fn(trainer, trainer.lightning_module, *args, **kwargs)"),
            (f"{USER_ROOT}/project/callbacks.py", 58, "on_train_batch_start", call),
        ]


FLAVOURS: dict[str, type[Flavour]] = {
    cls.name: cls for cls in (Megatron, DeepSpeed, FSDP, Lightning, Flavour, HFTrainer, NeMo)
}
# What ``flavour="auto"`` chooses from: the original five, so that a seed keeps the job it always gave.
AUTO_FLAVOURS = ("megatron", "deepspeed", "fsdp", "lightning", "plain")


def torch_save_frames(lib: str) -> list[Frame]:
    """torch.save down to the write that fails when the disk is full."""
    return [
        (f"{lib}/torch/serialization.py", 628, "save", "_save(obj, opened_zipfile, pickle_module, pickle_protocol)"),
        (f"{lib}/torch/serialization.py", 862, "_save", "zip_file.write_record(name, storage.data_ptr(), num_bytes)"),
    ]
