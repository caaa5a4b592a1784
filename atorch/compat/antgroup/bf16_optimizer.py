"""ATorch's ``BF16Optimizer``: fp32 master weights for a model cast to bf16 (``half`` with bf16).

ATorch's ``auto_accelerate`` wraps the optimizer in it under ``("half", "bf16")`` without
fsdp/ZeRO; this front does the same, so the weights keep updates smaller than bf16's resolution.
"""

import torch

from atorch.utils.optim import OptimizerWrapper


class BF16Optimizer(OptimizerWrapper):
    """Wraps an optimizer built over half-precision parameters: it steps fp32 copies of them
    (the master weights) and copies the result back into the model.

    Example::

        model = model.to(torch.bfloat16)
        optim = BF16Optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))
        loss.backward(); optim.step()    # AdamW steps the fp32 copies; the model gets them in bf16
    """

    def __init__(self, optimizer: torch.optim.Optimizer):
        super().__init__(optimizer)
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (model parameter, fp32 master)
        for group in optimizer.param_groups:
            for index, param in enumerate(group["params"]):
                if param.requires_grad and param.dtype in (torch.bfloat16, torch.float16):
                    master = param.detach().clone().float().requires_grad_(True)
                    group["params"][index] = master
                    if param in optimizer.state:
                        optimizer.state[master] = optimizer.state.pop(param)
                    self._pairs.append((param, master))

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for param, master in self._pairs:
            master.grad = None if param.grad is None else param.grad.detach().float()
        result = self.optimizer.step()
        with torch.no_grad():
            for param, master in self._pairs:
                param.copy_(master)
        return loss if closure is not None else result

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for param, _ in self._pairs:
            if set_to_none:
                param.grad = None
            elif param.grad is not None:
                param.grad.zero_()

    @property
    def master_params(self) -> list[torch.Tensor]:
        return [master for _, master in self._pairs]

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "master": [m.detach().clone() for m in self.master_params]}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        with torch.no_grad():
            for (param, master), saved in zip(self._pairs, state["master"], strict=True):
                master.copy_(saved)
                param.copy_(saved)
