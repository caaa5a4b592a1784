"""Training runs of a tiny GPT-2 under transformers.Trainer and AtorchTrainer, for the 2-rank tests."""

import os

import torch

from tests.helpers.hf import CountingTokens, tiny_gpt2

PER_DEVICE = 2


def train_trainer(output_dir, strategy=None, plain: bool = False, steps: int = 10, lr: float = 1e-2,
                  per_device: int = PER_DEVICE, resume: str | None = None, save_steps: int | None = None,
                  grad_accum: int = 2, max_grad_norm: float = 1.0, search: dict | None = None,
                  eval_steps: int | None = None, bf16: bool = False) -> dict:
    """Fine-tune the tiny GPT-2 with the Trainer's own loop; the losses it logs (every step)."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    logs: list[dict] = []

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs_=None, **kwargs):
            logs.append(dict(kwargs.get("logs") or logs_ or {}))

    args = TrainingArguments(
        output_dir, per_device_train_batch_size=per_device, per_device_eval_batch_size=per_device,
        max_steps=steps, learning_rate=lr, weight_decay=0.01, lr_scheduler_type="linear", warmup_steps=2,
        logging_steps=1, gradient_accumulation_steps=grad_accum, max_grad_norm=max_grad_norm,
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
        eval_strategy="steps" if eval_steps else "no", eval_steps=eval_steps,
        bf16=bf16, report_to=[], use_cpu=True, seed=0, disable_tqdm=True, dataloader_drop_last=True,
    )
    model = tiny_gpt2()
    # transformers 5.24's Trainer reads the model's loss_type to tell whether its loss shifts the
    # labels; GPT2LMHeadModel's is None (its loss falls back to ForCausalLM at call time), so the
    # plain Trainer would count each row's first label too and train on 15/16 of the token mean.
    # Named, the reference counts what the loss counts, as AtorchTrainer does for any causal LM.
    model.loss_type = "ForCausalLM"
    # The dtype the first block's MLP computes in while training (bf16 under amp or FSDP2's cast).
    compute_dtypes: set[str] = set()
    model.transformer.h[0].mlp.c_fc.register_forward_hook(
        lambda module, inputs, output: compute_dtypes.add(str(output.dtype)) if torch.is_grad_enabled() else None)
    kwargs = dict(model=model, args=args, train_dataset=CountingTokens(64),
                  eval_dataset=CountingTokens(16) if eval_steps else None, callbacks=[Record()])
    if plain:
        trainer = Trainer(**kwargs)
    else:
        from atorch.integrations.transformers import AtorchTrainer

        trainer = AtorchTrainer(strategy=strategy, **kwargs, **(search or {}))
    trainer.train(resume_from_checkpoint=resume)
    train_logs = [entry for entry in logs if "loss" in entry]
    return {
        "losses": [entry["loss"] for entry in train_logs],
        "grad_norms": [float(entry["grad_norm"]) for entry in train_logs],
        "lrs": [entry["learning_rate"] for entry in train_logs],
        "eval_losses": [entry["eval_loss"] for entry in logs if "eval_loss" in entry],
        "strategy": None if plain else trainer.strategy.to_json(),
        "wrapped": type(trainer.model_wrapped).__name__,
        "compute_dtypes": sorted(compute_dtypes),
        "files": sorted(os.listdir(output_dir)),
    }
