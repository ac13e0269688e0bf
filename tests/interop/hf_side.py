"""The transformers side of the parity tests; runs in the side venv (torch + transformers 5.23).

    python hf_side.py make --config CONFIG.json --seed N --out DIR
        builds MiniMaxM3SparseForConditionalGeneration from transformers config kwargs, draws
        random weights (weight_scales.py), writes DIR/upstream (save_pretrained: the upstream
        layout, sharded) and DIR/memory (state_dict in transformers' in-memory layout).
    python hf_side.py run --model DIR --inputs INPUTS.npz --out RESULTS.npz
        loads DIR with from_pretrained and runs every case of INPUTS.npz.
    python hf_side.py generate --model DIR --inputs INPUTS.npz --max-new-tokens N --out OUT.npz
        greedy `generate` of N new tokens for every (one-row) case: OUT.npz holds C.tokens [1, N].

INPUTS.npz holds, per case C: C.input_ids [B, S] and optionally C.pixel_values, C.image_grid_thw,
C.pixel_values_videos, C.video_grid_thw. RESULTS.npz holds per case: C.logits [B, S, V];
C.hidden.I (I = 0: the first layer's input, I > 0: layer I-1's output) [B, S, D];
C.blocks.L [B, Hi, S, k] selected key blocks of MSA layer L (-1 = none); C.experts.L [B·S, k]
router choices of MoE layer L; C.clamped_gate / C.clamped_up: fractions of dense and shared-expert
pre-activations beyond the swigluoai limits; and loading_info: what from_pretrained reported as
missing, unexpected or mismatched (a JSON string).

Uses no image/video processor (they need torchvision, spec §10): pixel rows come from the caller.
"""

import argparse
import json
import pathlib
import sys

import numpy as np
import torch
from safetensors.torch import save_file
from transformers import MiniMaxM3SparseForConditionalGeneration, MiniMaxM3VLConfig
from weight_scales import weight_scale

MEDIA = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")


def make(config_path: str, seed: int, out: str) -> None:
    config = MiniMaxM3VLConfig(**json.loads(pathlib.Path(config_path).read_text()))
    torch.manual_seed(seed)
    model = MiniMaxM3SparseForConditionalGeneration(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if "inv_freq" in name:  # rotary tables, not weights
                continue
            mean, std = weight_scale(name, tuple(tensor.shape))
            tensor.copy_(mean + std * torch.randn(tensor.shape, generator=generator))
    out = pathlib.Path(out)
    model.save_pretrained(out / "upstream", max_shard_size="40KB")
    (out / "memory").mkdir(parents=True)
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    save_file(state, out / "memory" / "model.safetensors", metadata={"format": "pt"})
    (out / "memory" / "config.json").write_text((out / "upstream" / "config.json").read_text())


def run(model_dir: str, inputs_path: str, out: str) -> None:
    model, info = load(model_dir)
    inputs = np.load(inputs_path)
    results = {
        "loading_info": np.array(json.dumps({k: sorted(map(str, v)) for k, v in info.items()}))
    }
    for case, kwargs in cases(inputs):
        with Recorder(model) as recorder, torch.no_grad():
            logits = model(**kwargs).logits
        results[f"{case}.logits"] = logits.numpy()
        for key, value in recorder.results().items():
            results[f"{case}.{key}"] = value
    np.savez(out, **results)


def generate(model_dir: str, inputs_path: str, max_new_tokens: int, out: str) -> None:
    """Greedy `generate` (KV cache on, transformers' default) of every case, one row each."""
    model, _ = load(model_dir)
    results = {}
    for case, kwargs in cases(np.load(inputs_path)):
        prompt_length = kwargs["input_ids"].shape[1]
        with torch.no_grad():
            ids = model.generate(
                **kwargs, attention_mask=torch.ones_like(kwargs["input_ids"]), do_sample=False,
                max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, pad_token_id=0,
            )  # fmt: skip
        results[f"{case}.tokens"] = ids[:, prompt_length:].numpy()
    np.savez(out, **results)


def load(model_dir: str):
    model, info = MiniMaxM3SparseForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32, output_loading_info=True
    )
    return model.eval(), info


def cases(inputs):
    """(case, transformers kwargs) for every case C of an INPUTS.npz."""
    for case in sorted({key.split(".")[0] for key in inputs.files}):
        yield case, {
            name: torch.from_numpy(inputs[f"{case}.{name}"])
            for name in ("input_ids", *MEDIA)
            if f"{case}.{name}" in inputs.files
        }


class Recorder:
    """Forward hooks on every decoder layer, indexer, router and dense/shared MLP."""

    def __init__(self, model):
        self.model, self.handles = model, []
        self.hidden, self.blocks, self.experts = {}, {}, {}
        self.clamps = np.zeros(3)  # gate > limit, |up| > limit, elements

    def __enter__(self):
        text = self.model.model.language_model
        limit = text.config.swiglu_limit
        hook = self.handles.append
        hook(text.layers[0].register_forward_pre_hook(self._store_input, with_kwargs=True))
        for i, layer in enumerate(text.layers):
            hook(
                layer.register_forward_hook(
                    lambda m, a, out, i=i: self._store(self.hidden, i + 1, out)
                )
            )
            if layer.self_attn.indexer is not None:
                hook(layer.self_attn.indexer.register_forward_hook(
                    lambda m, a, out, i=i: self._store(self.blocks, i, out)))  # fmt: skip
            mlp = layer.mlp
            if hasattr(mlp, "gate"):
                hook(mlp.gate.register_forward_hook(
                    lambda m, a, out, i=i: self._store(self.experts, i, out[2])))  # fmt: skip
                mlp = mlp.shared_experts
            hook(mlp.gate_up_proj.register_forward_hook(lambda m, a, out: self._clamps(out, limit)))
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()

    def _store_input(self, module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        self.hidden[0] = hidden.detach().numpy().copy()

    def _store(self, table, key, value):
        table[key] = value.detach().numpy().copy()

    def _clamps(self, gate_up, limit):
        gate, up = gate_up.detach().chunk(2, dim=-1)
        self.clamps += [(gate > limit).sum().item(), (up.abs() > limit).sum().item(), gate.numel()]

    def results(self) -> dict:
        out = {f"hidden.{i}": h for i, h in self.hidden.items()}
        out |= {f"blocks.{i}": b for i, b in self.blocks.items()}
        out |= {f"experts.{i}": e for i, e in self.experts.items()}
        out["clamped_gate"] = np.array(self.clamps[0] / self.clamps[2])
        out["clamped_up"] = np.array(self.clamps[1] / self.clamps[2])
        return out


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    commands = parser.add_subparsers(dest="command", required=True)
    make_parser = commands.add_parser("make")
    make_parser.add_argument("--config", required=True)
    make_parser.add_argument("--seed", type=int, required=True)
    make_parser.add_argument("--out", required=True)
    run_parser = commands.add_parser("run")
    run_parser.add_argument("--model", required=True)
    run_parser.add_argument("--inputs", required=True)
    run_parser.add_argument("--out", required=True)
    generate_parser = commands.add_parser("generate")
    generate_parser.add_argument("--model", required=True)
    generate_parser.add_argument("--inputs", required=True)
    generate_parser.add_argument("--max-new-tokens", type=int, required=True)
    generate_parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    if args.command == "make":
        make(args.config, args.seed, args.out)
    elif args.command == "run":
        run(args.model, args.inputs, args.out)
    else:
        generate(args.model, args.inputs, args.max_new_tokens, args.out)


if __name__ == "__main__":
    main(sys.argv[1:])
