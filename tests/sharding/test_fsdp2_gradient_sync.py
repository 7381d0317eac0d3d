"""Two CPU processes (gloo): what reducing gradients after every micro-batch changes under FSDP2, the mode
`run_plan.reduces_gradients_each_micro_batch` chooses for full fine-tuning. Accumulated over three micro-batches,
accelerate's `no_sync` (FSDP2's `set_requires_gradient_sync(False)`) keeps every parameter's whole gradient on every
rank until the last one; reduced each micro-batch, no rank holds a whole gradient between them, and the accumulated
sharded gradients are the same sums (fp32 here: equal within reassociation)."""

from __future__ import annotations

import textwrap

from trl_turbo.testing.multi_gpu import per_rank_reports

SCRIPT = textwrap.dedent(
    """
    import json, sys, warnings
    warnings.simplefilter("ignore")
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from trl_turbo.testing.models import tiny_model
    from trl_turbo.testing.multi_gpu import leave_finished_process

    dist.init_process_group("gloo")
    rank = dist.get_rank()

    def whole_gradient_bytes(model):
        # the unsharded gradients FSDP2 holds for its parameter groups (kept across `no_sync` micro-batches)
        total = 0
        for module in model.modules():
            state = getattr(module, "_get_fsdp_state", None)
            group = state()._fsdp_param_group if state is not None else None
            for param in group.fsdp_params if group is not None else ():
                for grad in (param.unsharded_accumulated_grad, param._unsharded_param.grad):
                    total += 0 if grad is None else grad.numel() * grad.element_size()
        return total

    def accumulate(sync_each):
        model = tiny_model("llama", vocab_size=64, hidden_size=32, layers=3, intermediate_size=64, seed=0)
        whole = sum(p.numel() * p.element_size() for p in model.parameters())
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        torch.manual_seed(1 + rank)
        held = []
        for index in range(3):
            ids = torch.randint(4, 64, (2, 24))
            model.set_requires_gradient_sync(sync_each or index == 2)  # what accelerate's `no_sync` toggles
            model(input_ids=ids, labels=ids).loss.backward()
            held.append(whole_gradient_bytes(model))
        grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
        return held, grads, whole

    held_no_sync, reference, whole = accumulate(False)
    held_each, grads, _ = accumulate(True)
    report = {"whole": whole, "held_no_sync": held_no_sync, "held_each": held_each,
              "max_rel": max(float((grads[n] - reference[n]).abs().max() / reference[n].abs().max())
                             for n in reference)}
    with open(sys.argv[1] + f".{rank}", "w") as handle:
        json.dump(report, handle)
    leave_finished_process()
    """
)


def test_reducing_each_micro_batch_holds_no_whole_gradients_and_sums_the_same(tmp_path):
    for report in per_rank_reports(SCRIPT, tmp_path):
        # no_sync: the whole model's gradients on every rank after each micro-batch but the last
        assert report["held_no_sync"][:2] == [report["whole"]] * 2 and report["held_no_sync"][2] == 0
        assert report["held_each"] == [0, 0, 0]
        assert 0 < report["max_rel"] < 1e-5 or report["max_rel"] == 0.0
