"""What the benchmark's reference scripts share: a Trainer callback that clocks the optimizer
steps and collects the losses, and the process's peak resident memory."""
import time
from pathlib import Path


def peak_rss_mib() -> float:
    """VmHWM: the most resident memory this process has held."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def step_clock():
    """A TrainerCallback recording when the first step begins (unix time, for startup), when
    each step ends and each logged loss. `timings()` gives the result keys bench.py reads."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self):
            self.first_step_unix, self.first_step_perf = None, None
            self.step_ends, self.losses = [], []

        def on_step_begin(self, args, state, control, **kw):
            if self.first_step_unix is None:
                self.first_step_unix, self.first_step_perf = time.time(), time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.step_ends.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                self.losses.append(logs["loss"])

        def timings(self) -> dict:
            ends = [self.first_step_perf] + self.step_ends
            return {
                "first_step_unix": self.first_step_unix,
                "step_s": [b - a for a, b in zip(ends, ends[1:])],
                "losses": self.losses,
                "peak_rss_mib": peak_rss_mib(),
            }

    return StepClock()


def bench_training_args(output_dir: str, args, learning_rate: float, **more):
    """TrainingArguments every reference run shares: args.batch_size per process, args.steps
    optimizer steps, a linear schedule without weight decay, a loss logged every step, nothing
    saved or reported, the CPU, bf16 autocast when args.precision says so, args.seed."""
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=output_dir, per_device_train_batch_size=args.batch_size, max_steps=args.steps,
        learning_rate=learning_rate, lr_scheduler_type="linear", weight_decay=0.0, logging_steps=1,
        save_strategy="no", report_to="none", disable_tqdm=True, use_cpu=True,
        bf16=args.precision == "bf16", dataloader_num_workers=0, seed=args.seed, **more,
    )
