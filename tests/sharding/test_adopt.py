"""Two CPU processes (gloo): accelerate's own `fsdp2_prepare_model`, patched by trl_turbo, shards a tiny PEFT Llama on
the tensor-parallel dimensions of a waiting engine and makes each rank's frozen shards views of that engine's slices.

The engine stands in for vLLM's TP rank: a tensor per vLLM parameter (packed q|k|v and gate|up, row-parallel o/down,
vocabulary blocks, whole norms), filled by a loader that narrows whole tensors by hand-written rules (vLLM's own
loader is used on the GPU). Checked per rank: every shared projection's FSDP2 storage is the engine's memory, the
sharded model's logits equal the unsharded model's, a write into the engine is what FSDP2's next forward computes
with, LoRA trains while the engine's base bytes stay bitwise the same, and a rank whose engine slice differs makes
every rank refuse (no hang, nothing adopted). Merged sampling writes the adapter into the engine's slices and
restores them bitwise; with full fine-tuning the engine holds the trained shards (adopted, or cast in at a sync) and
a sync reloads the norms it lays out itself.
"""

from __future__ import annotations

import textwrap

from trl_turbo.testing.multi_gpu import per_rank_reports

SCRIPT = textwrap.dedent(
    """
    import copy, json, sys, warnings
    from types import SimpleNamespace
    warnings.simplefilter("ignore")
    import torch
    import torch.distributed as dist
    from accelerate.utils import FullyShardedDataParallelPlugin
    from peft import LoraConfig, get_peft_model

    import trl_turbo
    import accelerate.accelerator
    from trl_turbo import registry
    from trl_turbo.sharding.shard_placement import model_facts
    from trl_turbo.ops.merge_fp8 import FP8_DTYPE, FP8_MAX
    from trl_turbo.sharding.tp_layout import PROJECTIONS, tp_layout
    from trl_turbo.vllm.fp8 import Fp8Tensor
    from trl_turbo.sharding.adopt import fsdp_params
    from trl_turbo.testing.models import tiny_model
    from trl_turbo.testing.multi_gpu import leave_finished_process
    from trl_turbo.vllm.sharded import PENDING_ATTRIBUTE, ShardedShare
    from trl_turbo.vllm.weight_views import LayoutMismatch, hf_weight_name

    dist.init_process_group("gloo")
    rank, T = dist.get_rank(), dist.get_world_size()


    class Engine:
        # vLLM's TP rank `rank`: one tensor per vLLM parameter, NaN until loaded (`fp8`: the projections are e4m3
        # tensors with a scale each, as vLLM's online fp8 holds them)
        def __init__(self, facts, shapes, corrupt=None, dtype=torch.float32, fp8=False):
            self.tp_rank, self.facts, self.corrupt, self.tensors = rank, facts, corrupt, {}
            self.scales, self.loaded, self.in_place = {}, [], []
            for name, shape in shapes.items():
                layout = tp_layout(name, shape, facts, T, rank)
                size = list(shape)
                if layout.slice is not None and layout.slice.dim is not None:
                    size[layout.slice.dim] = layout.slice.local_size
                if fp8 and name.rsplit(".", 2)[-2] in PROJECTIONS:
                    self.tensors.setdefault(layout.vllm_name, torch.zeros(size, dtype=FP8_DTYPE))
                    self.scales.setdefault(layout.vllm_name, torch.zeros(1))
                else:
                    self.tensors.setdefault(layout.vllm_name, torch.full(size, float("nan"), dtype=dtype))

        def load(self, tensors):
            for hf_name, full in tensors:
                self.load_one(hf_name, full)

        def load_one(self, hf_name, full):
            self.loaded.append(hf_name)
            layout = tp_layout(hf_name, full.shape, self.facts, T, rank)
            s, target = layout.slice, self.tensors[layout.vllm_name]
            if s.dim is None:
                target.copy_(full)
                return
            piece = full.narrow(s.dim, s.start, s.length)
            if hf_name == self.corrupt:
                piece = piece + 1
            if torch.equal(target.narrow(s.dim, s.offset, s.length), piece):
                self.in_place.append(hf_name)  # already there: written while accelerate loaded the shards
            target.narrow(s.dim, s.offset, s.length).copy_(piece)

        def slice_of(self, layout):
            s = layout.slice
            tensor = self.tensors[layout.vllm_name]
            return tensor if s.dim is None else tensor.narrow(s.dim, s.offset, s.length)


    def build(lora=True):
        torch.manual_seed(0)
        base = tiny_model("llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, layers=2)
        if not lora:
            return base
        model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                                init_lora_weights=False))
        return model


    class Standby:
        # the KV standby's side: which storages full fine-tuning hands over to release with the KV cache
        released, weight_releases, handed = False, 0, ()

        def release_also(self, tensors):
            self.handed = list(tensors)
            return 1


    def prepare(model, engine, merged=False, engine_dtype=torch.float32, standby=None, fp8=None, efficient=False,
                park=True):
        state = SimpleNamespace(shared_bytes=0, copy_bytes=0, merged=None, fp8=None, weight_copies=None,
                                standby=standby)
        share = ShardedShare(lambda: engine, engine_dtype, T, state, merged=merged, fp8=fp8, park_fp8_base=park)
        registry.replace_attr(model, PENDING_ATTRIBUTE, share, weak=True)
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["LlamaDecoderLayer"], cpu_ram_efficient_loading=efficient)
        accelerator = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin), torch_device_mesh=None,
                                      mixed_precision="no", device=torch.device("cpu"), is_main_process=rank == 0)
        return accelerate.accelerator.fsdp2_prepare_model(accelerator, model), share, state


    report = {}
    model = build()
    reference = copy.deepcopy(model)
    facts = model_facts(model)
    shapes = {n.removeprefix("base_model.model.").replace(".base_layer", ""): tuple(p.shape)
              for n, p in model.named_parameters() if "lora_" not in n}
    engine = Engine(facts, shapes)
    model, share, state = prepare(model, engine)

    storages = {t.untyped_storage().data_ptr() for t in engine.tensors.values()}
    adopted = [name for name, fp in ((n, fsdp_params(model).get(id(p))) for n, p in model.named_parameters())
               if fp is not None and fp._sharded_param_data.untyped_storage().data_ptr() in storages]
    report["adopted"] = len(adopted)
    report["shared"] = len(share.result.shared)
    report["own_copies"] = sorted(share.result.own_copies)
    report["shared_bytes"] = state.shared_bytes
    report["engine_nan"] = any(t.isnan().any().item() for t in engine.tensors.values())
    report["in_place"] = len(engine.in_place)

    # accelerate's memory-efficient loading (TRL's fsdp2.yaml): rank 0's weights are broadcast and each shared shard
    # is written straight into the engine, never kept beside it (the other ranks start from empty weights)
    loaded = build()
    if rank != 0:
        with torch.no_grad():
            for param in loaded.parameters():
                param.zero_()
    loading_engine = Engine(facts, shapes)
    loaded, loaded_share, _ = prepare(loaded, loading_engine, efficient=True)
    engine_storages = {t.untyped_storage().data_ptr() for t in loading_engine.tensors.values()}
    report["efficient"] = {
        "shared": len(loaded_share.result.shared), "in_place": sorted(set(loading_engine.in_place)),
        "adopted": sum(fp._sharded_param_data.untyped_storage().data_ptr() in engine_storages
                       for fp in fsdp_params(loaded).values())}
    probe = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(loaded(input_ids=probe).logits, reference(input_ids=probe).logits)
    # loaded in place, a slice the engine's loader lays out otherwise is still refused on every rank: its shard's
    # values were kept aside before the loader wrote over them
    refusing = Engine(facts, shapes, corrupt="model.layers.1.mlp.up_proj.weight" if rank == 1 else None)
    try:
        prepare(build(), refusing, efficient=True)
        report["efficient"]["refused"] = None
    except LayoutMismatch as error:
        report["efficient"]["refused"] = str(error)

    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits)
    # the engine writes (as a merge would): FSDP2's next forward computes with it
    qkv = engine.tensors["model.layers.0.self_attn.qkv_proj.weight"]
    with torch.no_grad():
        qkv.mul_(2)
        reference.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight.mul_(2)
        reference.base_model.model.model.layers[0].self_attn.k_proj.weight.mul_(2)
        reference.base_model.model.model.layers[0].self_attn.v_proj.base_layer.weight.mul_(2)
    torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits)

    before = {name: t.clone() for name, t in engine.tensors.items()}
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    lora_before = {n: p.to_local().clone() for n, p in model.named_parameters() if "lora_B" in n}
    for _ in range(2):
        model(input_ids=ids).logits.pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    report["lora_moved"] = all(not torch.equal(p.to_local(), lora_before[n])
                               for n, p in model.named_parameters() if "lora_B" in n)
    report["base_unchanged"] = all(torch.equal(t, before[name]) for name, t in engine.tensors.items())

    # merged sampling per shard: the adapter lands in the engine's slices, and comes back out bit-exactly
    model = build()
    reference = copy.deepcopy(model)
    engine = Engine(facts, shapes)
    model, share, state = prepare(model, engine, merged=True)
    before = {name: t.clone() for name, t in engine.tensors.items()}
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as comm:  # every collective, DTensor's own included
        state.merged.merge()  # (a forward of the training model now would restore first: its guard hook)
    report["merge_gathers"] = comm.get_total_counts()  # every layer's LoRA factors, gathered whole at once
    report["merge_changed"] = sorted(name for name, t in engine.tensors.items() if not torch.equal(t, before[name]))
    merged_reference = reference.merge_and_unload().model.layers[1]
    q_rows = slice(rank * 32, (rank + 1) * 32)  # 2 of the 4 heads of 16 per rank
    torch.testing.assert_close(engine.tensors["model.layers.1.self_attn.qkv_proj.weight"][:32],
                               merged_reference.self_attn.q_proj.weight[q_rows])  # column-parallel: B's rows
    torch.testing.assert_close(engine.tensors["model.layers.1.mlp.down_proj.weight"],
                               merged_reference.mlp.down_proj.weight[:, rank * 64:(rank + 1) * 64])  # A's columns
    state.merged.restore()
    report["restored_bitwise"] = all(torch.equal(t, before[name]) for name, t in engine.tensors.items())

    # fp8 sampling per shard: vLLM's projections are e4m3 tensors written from FSDP2's own shards (never loaded,
    # never shared), under the rank's own scale; the 16-bit shards leave the device while vLLM samples
    model = build()
    reference = copy.deepcopy(model)
    engine = Engine(facts, shapes, fp8=True)
    fp8 = {name: Fp8Tensor(t, engine.scales[name]) for name, t in engine.tensors.items() if t.dtype == FP8_DTYPE}
    model, share, state = prepare(model, engine, fp8=fp8)
    projections = {n: p for n, p in model.named_parameters()
                   if "lora_" not in n and hf_weight_name(n).rsplit(".", 2)[-2] in PROJECTIONS}
    base_before = {n: p.to_local().clone() for n, p in projections.items()}
    with CommDebugMode() as comm:
        state.fp8.write()
    report["fp8_gathers"] = comm.get_total_counts()

    def expected_fp8(model, layer, vllm_name):
        # the rank's rows (column-parallel) or columns (row-parallel) of W + scaling * B @ A, computed whole in
        # fp32 from the unsharded model and cut by hand: 2 of 4 q heads, 1 of 2 k/v heads, half of the MLP
        def merged(module):
            if not hasattr(module, "lora_A"):
                return module.weight.detach().float()
            delta = module.lora_B["default"].weight.detach().float() @ module.lora_A["default"].weight.float()
            return module.base_layer.weight.detach().float() + module.scaling["default"] * delta
        attention, mlp = layer.self_attn, layer.mlp
        rows = lambda w, n: w[rank * n:(rank + 1) * n]
        cols = lambda w: w[:, rank * w.shape[1] // T:(rank + 1) * w.shape[1] // T]
        whole = {"self_attn.qkv_proj": torch.cat([rows(merged(attention.q_proj), 32),
                                                  rows(merged(attention.k_proj), 16),
                                                  rows(merged(attention.v_proj), 16)]),
                 "self_attn.o_proj": cols(merged(attention.o_proj)),
                 "mlp.gate_up_proj": torch.cat([rows(merged(mlp.gate_proj), 64), rows(merged(mlp.up_proj), 64)]),
                 "mlp.down_proj": cols(merged(mlp.down_proj))}[vllm_name.split(".", 3)[3].rsplit(".", 1)[0]]
        scale = whole.abs().max() / FP8_MAX
        return (whole / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale

    def same_fp8(tensor, expected):
        return (torch.equal(tensor.rows.view(torch.uint8), expected[0].view(torch.uint8))
                and torch.allclose(tensor.scale, expected[1]))

    layers = reference.base_model.model.model.layers
    report["fp8"] = {
        "loaded": sorted(set(engine.loaded)),
        "shared": len(share.result.shared), "kept": len(share.result.kept),
        "written_as_expected": sorted(name for name, t in fp8.items() if same_fp8(t, expected_fp8(
            reference, layers[int(name.split(".")[2])], name))),
        "parked": sorted(n for n, p in projections.items() if p.to_local().untyped_storage().nbytes() == 0),
    }
    torch.testing.assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits)  # brought back first
    report["fp8"]["back_bitwise"] = all(torch.equal(p.to_local(), base_before[n]) for n, p in projections.items())
    qkv_before = fp8["model.layers.0.self_attn.qkv_proj.weight"].rows.clone()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model(input_ids=ids).logits.pow(2).mean().backward()
    optimizer.step()
    state.fp8.write()
    state.fp8.unpark()
    report["fp8"]["follows_the_adapter"] = not torch.equal(qkv_before.view(torch.uint8),
                                                           fp8["model.layers.0.self_attn.qkv_proj.weight"].rows.view(
                                                               torch.uint8))
    report["fp8"]["base_after_training"] = all(torch.equal(p.to_local(), base_before[n])
                                               for n, p in projections.items())
    report["fp8"]["parked_gib"] = state.fp8.take_metrics()["vllm/parked_host_gib"]

    # full fine-tuning: every weight trains. Same dtype as the engine: the shards are the engine's memory, so the
    # optimizer's update is what it samples, and a sync only reloads what it lays out itself (the norms)
    def train_step(model):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model(input_ids=ids).logits.pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()

    engine = Engine(facts, shapes)
    model, share, state = prepare(build(lora=False), engine)
    train_step(model)
    copies = state.weight_copies
    report["full_ft_same_dtype"] = {"shared": len(share.result.shared), "casts": len(copies.casts),
                                    "reloads": sorted(name for name, _ in copies.reloads)}
    copies.sync()
    params = dict(model.named_parameters())
    report["full_ft_same_dtype"]["engine_is_trained"] = all(
        torch.equal(engine.slice_of(entry.layouts[rank]), params[entry.name].to_local())
        for entry in share.placement.plan.params if entry.kind == "shared")
    report["full_ft_same_dtype"]["norms_synced"] = torch.equal(engine.tensors["model.norm.weight"],
                                                               params["model.norm.weight"].full_tensor())
    # fp32 masters over a bf16 engine: each shard is cast into its slice at a sync, rank-locally
    engine = Engine(facts, shapes, dtype=torch.bfloat16)
    standby = Standby()
    model, share, state = prepare(build(lora=False), engine, engine_dtype=torch.bfloat16, standby=standby)
    handed = {h.untyped_storage().data_ptr() for h in standby.handed}
    released = sorted(name for name, t in engine.tensors.items() if t.untyped_storage().data_ptr() in handed)
    train_step(model)
    copies = state.weight_copies
    copies.sync()
    params = dict(model.named_parameters())
    report["full_ft_cast"] = {
        "shared": len(share.result.shared), "casts": len(copies.casts), "reloads": len(copies.reloads),
        "released_with_kv": released,
        "engine_is_trained": all(
            torch.equal(engine.slice_of(entry.layouts[rank]), params[entry.name].to_local().to(torch.bfloat16))
            for entry in share.placement.plan.params if entry.kind == "cast")}

    # full fine-tuning with fp8 sampling, fp32 masters over a bf16 engine whose projections are e4m3: each rank's
    # fp8 tensors are written from its trained shards (never loaded, never cast; nothing parked), the embeddings
    # and LM head cast at each sync, the norms reloaded
    engine = Engine(facts, shapes, dtype=torch.bfloat16, fp8=True)
    fp8 = {name: Fp8Tensor(t, engine.scales[name]) for name, t in engine.tensors.items() if t.dtype == FP8_DTYPE}
    model, share, state = prepare(build(lora=False), engine, engine_dtype=torch.bfloat16, fp8=fp8, park=False)
    train_step(model)
    state.weight_copies.sync()
    state.fp8.write()
    trained = build(lora=False)
    missing, unexpected = trained.load_state_dict({n: p.full_tensor() for n, p in model.named_parameters()},
                                                  strict=False)  # every rank gathers the same tensors in turn
    report["full_ft_fp8"] = {
        "kept": len(share.result.kept), "casts": len(state.weight_copies.casts),
        "reloads": len(state.weight_copies.reloads), "unloaded": sorted(missing + unexpected),
        "loaded_projections": sorted(n for n in set(engine.loaded) if n.rsplit(".", 2)[-2] in PROJECTIONS),
        "written_as_expected": sorted(name for name, t in fp8.items() if same_fp8(t, expected_fp8(
            trained, trained.model.layers[int(name.split(".")[2])], name))),
        "parked": sorted(n for n, p in model.named_parameters() if p.to_local().untyped_storage().nbytes() == 0)}

    # one rank's engine slice differs: every rank refuses, none adopts
    model = build()
    engine = Engine(facts, shapes, corrupt="model.layers.1.mlp.up_proj.weight" if rank == 1 else None)
    try:
        prepare(model, engine)
        report["refused"] = None
    except LayoutMismatch as error:
        report["refused"] = str(error)
    report["adopted_after_refusal"] = sum(
        fp._sharded_param_data.untyped_storage().data_ptr() in {t.untyped_storage().data_ptr()
                                                                for t in engine.tensors.values()}
        for fp in fsdp_params(model).values())
    with open(sys.argv[1] + f".{rank}", "w") as handle:
        json.dump(report, handle)
    leave_finished_process()
    """
)


def test_fsdp2_shards_become_the_engine_slices(tmp_path):
    reports = per_rank_reports(SCRIPT, tmp_path)
    for report in reports:
        # 2 layers x 7 projections + embeddings + LM head shared (vocabulary 128 splits evenly); norms are whole
        assert report["adopted"] == report["shared"] == 16
        assert report["own_copies"] == sorted([f"model.layers.{i}.{n}.weight" for i in range(2)
                                               for n in ("input_layernorm", "post_attention_layernorm")]
                                              + ["model.norm.weight"])
        assert report["shared_bytes"] > 0 and not report["engine_nan"]
        assert report["in_place"] == 0  # without memory-efficient loading the engine is filled afterwards
        efficient = report["efficient"]
        assert efficient["shared"] == efficient["adopted"] == 16
        assert len(efficient["in_place"]) == 16  # every shared shard was already the engine's when it loaded
        assert efficient["refused"] is not None
        assert report["lora_moved"] and report["base_unchanged"]
        assert report["adopted_after_refusal"] == 0
        assert report["merge_gathers"] == report["fp8_gathers"] == 1
        assert report["merge_changed"] == sorted(f"model.layers.{i}.{n}" for i in range(2)
                                                 for n in ("self_attn.qkv_proj.weight", "mlp.down_proj.weight"))
        assert report["restored_bitwise"]
        norms = [f"model.layers.{i}.{n}.weight" for i in range(2)
                 for n in ("input_layernorm", "post_attention_layernorm")] + ["model.norm.weight"]
        assert report["full_ft_same_dtype"] == {"shared": 16, "casts": 0, "reloads": sorted(norms),
                                                "engine_is_trained": True, "norms_synced": True}
        # every storage the casts rewrite whole goes with the KV cache while training: all but the reloaded norms
        # (the packed q|k|v and gate|up tensors too, whose rows come from several casts)
        releasable = sorted(["model.embed_tokens.weight", "lm_head.weight"] + [
            f"model.layers.{i}.{n}.weight" for i in range(2)
            for n in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")])
        assert report["full_ft_cast"] == {"shared": 0, "casts": 16, "reloads": 5, "released_with_kv": releasable,
                                          "engine_is_trained": True}
        full_fp8 = report["full_ft_fp8"]
        assert full_fp8["kept"] == 14 and full_fp8["casts"] == 2 and full_fp8["reloads"] == 5
        assert full_fp8["loaded_projections"] == [] and full_fp8["unloaded"] == [] and full_fp8["parked"] == []
        assert full_fp8["written_as_expected"] == sorted(
            f"model.layers.{i}.{n}.weight" for i in range(2)
            for n in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"))
        fp8 = report["fp8"]
        # the projections are fp8 in the engine: neither loaded nor shared; the embeddings and LM head are shared
        assert fp8["shared"] == 2 and fp8["kept"] == 14
        assert fp8["loaded"] == sorted(["model.embed_tokens.weight", "lm_head.weight"] + norms)
        assert fp8["written_as_expected"] == sorted(f"model.layers.{i}.{n}.weight" for i in range(2) for n in (
            "self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"))
        assert len(fp8["parked"]) == 14 and fp8["parked_gib"] > 0
        assert fp8["back_bitwise"] and fp8["base_after_training"] and fp8["follows_the_adapter"]
    assert "on another rank" in reports[0]["refused"]  # rank 0's slices matched, and it still refused
    assert "model.layers.1.mlp.up_proj.weight: the engine's slice differs" in reports[1]["refused"]
    assert "on another rank" in reports[0]["efficient"]["refused"]
    assert "model.layers.1.mlp.up_proj.weight: the engine's slice differs" in reports[1]["efficient"]["refused"]


def test_a_kept_shard_must_be_the_engine_ranks_slice():
    """fp8-kept projections are written from FSDP2's shards: a shard of another shape, or another shard index than
    vLLM's tensor-parallel rank, is named (and so refused on every rank with the other mismatches)."""
    import types

    import torch

    from trl_turbo.sharding.adopt import kept_shard_problem
    from trl_turbo.sharding.tp_layout import VllmSlice

    def layout(rank, obstacle=None):
        return types.SimpleNamespace(slice=VllmSlice(dim=0, start=8 * rank, stop=8 * rank + 8, offset=0,
                                                     local_size=8), obstacle=obstacle)

    entry = types.SimpleNamespace(layouts=[layout(0), layout(1)])

    def shard(rows, index, dim=0, cols=4):
        shard_placement = types.SimpleNamespace(is_shard=lambda: True, dim=dim)
        replicate = types.SimpleNamespace(is_shard=lambda: False)
        return types.SimpleNamespace(shape=(16, cols), to_local=lambda: torch.zeros(rows, cols),
                                     placements=(replicate, shard_placement),
                                     device_mesh=types.SimpleNamespace(get_local_rank=lambda dim: index if dim == 1
                                                                       else 0))

    assert kept_shard_problem("q", shard(8, 1), entry, 1) is None
    assert "FSDP2's shard (16, 4), vLLM's slice (8, 4)" in kept_shard_problem("q", shard(16, 1), entry, 1)
    assert "holds shard 0 where vLLM's tensor-parallel rank is 1" in kept_shard_problem("q", shard(8, 0), entry, 1)
    # a square weight sharded along the other dim has the slice's shape all the same
    square = types.SimpleNamespace(shape=(16, 16), to_local=lambda: torch.zeros(8, 16), placements=(
        types.SimpleNamespace(is_shard=lambda: True, dim=1),), device_mesh=types.SimpleNamespace(
        get_local_rank=lambda dim: 1))
    assert "FSDP2 shards dim 1, vLLM's slice is along dim 0" in kept_shard_problem("o", square, entry, 1)
    blocked = types.SimpleNamespace(layouts=[layout(0), layout(1, obstacle="padded")])
    assert "(padded)" in kept_shard_problem("q", shard(8, 1), blocked, 1)
    unplaced = types.SimpleNamespace(layouts=[types.SimpleNamespace(slice=None)] * 2)
    assert kept_shard_problem("q", shard(16, 0), unplaced, 1) is None  # the sampler's own setup refuses it
