"""The mixed-precision optimizer's layout-independent state dict (chapter 02; not a page).

The form is described on the mixed-precision page: per parameter name, full fp32 tensors
(`fp32_param`, the inner optimizer's state), the groups' hyperparameters with their parameter
names, and the scaler's state. The DistributedOptimizer and chapter 03 reuse the two group
helpers.
"""

from __future__ import annotations

import torch


class LayoutFreeStateDict:
    """Mixin for MixedPrecisionOptimizer: state_dict / load_state_dict in the per-name form."""

    def state_dict(self) -> dict:
        """Layout-independent state: full fp32 master + optimizer state per param name."""
        params = {}
        for name, (_, main) in zip(self.names, self.pairs):
            entry = {"fp32_param": main.detach().clone()}
            for k, v in self._state_of[id(main)].get(main, {}).items():
                entry[k] = v.detach().clone() if torch.is_tensor(v) else v
            params[name] = entry
        return {"params": params, "param_groups": _group_hparams(self.param_groups, self.group_names),
                "grad_scaler": None if self.grad_scaler is None else self.grad_scaler.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        """Load the layout-independent form (any DP size saved it)."""
        _load_group_hparams(self.param_groups, sd["param_groups"])
        missing = [n for n in self.names if n not in sd["params"]]
        if missing:
            raise ValueError(f"optimizer state has no entry for params {missing[:5]}")
        for name, (model, main) in zip(self.names, self.pairs):
            entry = sd["params"][name]
            main.copy_(entry["fp32_param"])
            if model is not main:
                model.copy_(main)
            self._state_of[id(main)][main] = {
                k: (v.clone().to(main.device) if torch.is_tensor(v) else v)
                for k, v in entry.items() if k != "fp32_param"}
        if self.grad_scaler is not None and sd.get("grad_scaler") is not None:
            self.grad_scaler.load_state_dict(sd["grad_scaler"])


def _group_hparams(groups: list[dict], names: list[list[str]]) -> list[dict]:
    """Every group's hyperparameters, with the names of all its model params."""
    return [dict({k: v for k, v in g.items() if k != "params"}, param_names=list(n))
            for g, n in zip(groups, names)]


def _load_group_hparams(groups: list[dict], saved: list[dict]) -> None:
    """Copy saved hyperparameters into matching groups."""
    if len(groups) != len(saved):
        raise ValueError(f"checkpoint has {len(saved)} param groups, optimizer has {len(groups)}")
    for g, s in zip(groups, saved):
        g.update({k: v for k, v in s.items() if k not in ("params", "param_names")})
