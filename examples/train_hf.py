"""Train HF transformers Llama (pre-RMSNorm) and BERT (post-LayerNorm), and on request GPT-2 (pre-LayerNorm)
and the T5 encoder (pre-RMSNorm, with a token head), from small random-weight configs with
backend="fusenorm" and with plain Inductor from the same seed; print the match report summary (every norm
site: fused, or the reason it was not), both losses and both step times.

Needs ``transformers`` (the optional extra: ``pip install -e ".[examples]"``); without it this prints a note
and exits 0.

    python examples/train_hf.py                              # CPU: tiny configs, both models
    python examples/train_hf.py --model llama --plot /tmp/llama.png
    python examples/train_hf.py --model bert --hidden 1024 --layers 6 --batch 16 --seq 512   # CUDA defaults

Data: token sequences of a fixed random Markov chain (each token is followed by a fixed successor with
probability 0.9, else by a uniformly random token), so that both losses can fall: Llama is trained as a
causal LM (labels = inputs, shifted inside the model), as GPT-2, BERT as a masked LM (15% of the positions
replaced by a mask token and predicted), as the T5 encoder. The CUDA defaults are the shapes of the project's H200 baselines: Llama
h = 2048, 6 layers, batch 4 x 2048; BERT h = 1024, 6 layers, batch 16 x 512.

Dropout: the configs set every dropout probability to 0 (two compiled graphs would otherwise draw different
random masks). A zero-probability ``nn.Dropout`` traces to an ``aten.clone`` between BERT's output linear and
its residual add; fusenorm's post-norm pattern looks through it. (A dropout with p > 0 in training is a random
mask there: those post-norms stay unfused, and the report says why.)
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

MODELS = ("llama", "bert", "gpt2", "t5")
CAUSAL = ("llama", "gpt2")  # trained as causal LMs; the others as masked LMs
NAMES = {"llama": "HF Llama (pre-RMSNorm)", "bert": "HF BERT (post-LayerNorm)", "gpt2": "HF GPT-2 (pre-LayerNorm)",
         "t5": "HF T5 encoder (pre-RMSNorm, T5LayerNorm)"}
CUDA_DEFAULTS = {
    "llama": dict(hidden=2048, layers=6, heads=16, intermediate=5632, vocab=32000, batch=4, seq=2048),
    "bert": dict(hidden=1024, layers=6, heads=16, intermediate=4096, vocab=30522, batch=16, seq=512),
    "gpt2": dict(hidden=1024, layers=6, heads=16, intermediate=4096, vocab=50257, batch=16, seq=512),
    "t5": dict(hidden=1024, layers=6, heads=16, intermediate=4096, vocab=32128, batch=16, seq=512),
}
CPU_DEFAULTS = {k: dict(hidden=64, layers=2, heads=4, intermediate=128, vocab=128, batch=2, seq=16) for k in MODELS}


def have_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def make_model(kind: str, c: dict) -> nn.Module:
    """A random-weight LlamaForCausalLM / BertForMaskedLM of config ``c`` (fp32; the caller casts)."""
    import transformers

    common = dict(vocab_size=c["vocab"], hidden_size=c["hidden"], intermediate_size=c["intermediate"],
                  num_hidden_layers=c["layers"], num_attention_heads=c["heads"],
                  max_position_embeddings=max(c["seq"], 64), attn_implementation="sdpa")
    if kind == "llama":
        cfg = transformers.LlamaConfig(num_key_value_heads=c["heads"], attention_dropout=0.0, use_cache=False,
                                       rms_norm_eps=1e-6, **common)
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "bert":
        cfg = transformers.BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **common)
        model = transformers.BertForMaskedLM(cfg)
    elif kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=c["vocab"], n_positions=max(c["seq"], 64), n_embd=c["hidden"],
                                      n_layer=c["layers"], n_head=c["heads"], n_inner=c["intermediate"],
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                                      bos_token_id=mask_token(kind, c["vocab"]),
                                      eos_token_id=mask_token(kind, c["vocab"]), attn_implementation="sdpa")
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.T5Config(vocab_size=c["vocab"], d_model=c["hidden"], d_kv=c["hidden"] // c["heads"],
                                    d_ff=c["intermediate"], num_layers=c["layers"], num_heads=c["heads"],
                                    dropout_rate=0.0, feed_forward_proj="relu", use_cache=False)
        model = T5EncoderMLM(transformers.T5EncoderModel(cfg), c["hidden"], c["vocab"])
    return model


class T5EncoderMLM(nn.Module):
    """A T5 encoder with a linear token head, trained as a masked LM (the encoder alone has no loss)."""

    def __init__(self, encoder: nn.Module, hidden: int, vocab: int) -> None:
        super().__init__()
        self.encoder = encoder
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids, labels=None):
        logits = self.head(self.encoder(input_ids=input_ids).last_hidden_state)
        if labels is None:
            return logits
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)


def mask_token(kind: str, vocab: int) -> int:
    return vocab - 1  # reserved: the Markov chain never emits it (tokens are drawn from [0, vocab - 1))


def make_batches(kind: str, c: dict, n: int, device: str, seed: int = 1) -> list:
    """``n`` batches of token ids [batch, seq] from a fixed random Markov chain (see the module docstring):
    Llama: (ids, labels = ids); BERT: (ids with 15% masked, labels = the original ids there, -100 elsewhere)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    v = c["vocab"] - 1
    successor = torch.randperm(v, generator=gen)
    out = []
    for _ in range(n):
        ids = torch.empty(c["batch"], c["seq"], dtype=torch.long)
        ids[:, 0] = torch.randint(0, v, (c["batch"],), generator=gen)
        follow = torch.rand(c["batch"], c["seq"], generator=gen) < 0.9
        noise = torch.randint(0, v, (c["batch"], c["seq"]), generator=gen)
        for i in range(1, c["seq"]):
            ids[:, i] = torch.where(follow[:, i], successor[ids[:, i - 1]], noise[:, i])
        if kind in CAUSAL:
            out.append((ids.to(device), ids.to(device)))
        else:
            masked = torch.rand(c["batch"], c["seq"], generator=gen) < 0.15
            masked[:, 0] |= ~masked.any(1)  # at least one prediction per sequence
            labels = torch.where(masked, ids, torch.full_like(ids, -100))
            inputs = torch.where(masked, torch.full_like(ids, mask_token(kind, c["vocab"])), ids)
            out.append((inputs.to(device), labels.to(device)))
    return out


def lm_loss(model, batch):
    ids, labels = batch
    out = model(input_ids=ids, labels=labels)
    return out if isinstance(out, torch.Tensor) else out.loss


def logits(model, batch):
    """The inference forward: the token logits of the batch's inputs."""
    out = model(input_ids=batch[0])
    return out if isinstance(out, torch.Tensor) else out.logits


def model_config(kind: str, args) -> dict:
    c = dict((CUDA_DEFAULTS if torch.cuda.is_available() else CPU_DEFAULTS)[kind])
    for key in c:
        if getattr(args, key, None) is not None:
            c[key] = getattr(args, key)
    return c


def run_model(kind: str, args, device: str, dtype: torch.dtype, log=print) -> tuple[dict, dict]:
    """(the comparison, the config) for one model."""
    c = model_config(kind, args)
    batches = make_batches(kind, c, args.batches, device)
    result = _common.compare(lambda: make_model(kind, c), batches, lm_loss,
                             steps=args.steps, lr=args.lr, device=device, dtype=dtype, seed=args.seed,
                             timed=_common.timed_steps(args), backends=args.backends.split(","), log=log)
    return result, c


def parse_args(argv=None):
    p = _common.make_parser(__doc__)
    p.add_argument("--model", default="llama,bert", help=f"comma list of {', '.join(MODELS)}")
    for key in ("hidden", "layers", "heads", "intermediate", "vocab", "batch", "seq"):
        p.add_argument(f"--{key}", type=int, default=None,
                       help=f"default: llama {CUDA_DEFAULTS['llama'][key]}, bert {CUDA_DEFAULTS['bert'][key]} on "
                            f"CUDA; {CPU_DEFAULTS['llama'][key]} on the CPU")
    _common.add_common_args(p, steps_cpu=12, steps_cuda=200, lr=3e-4, report="summary")
    args = p.parse_args(argv)
    args.model = [m.strip() for m in args.model.split(",") if m.strip()]
    bad = [m for m in args.model if m not in MODELS]
    if bad:
        p.error(f"--model: {bad} not in {MODELS}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if not have_transformers():
        print("transformers is not installed: skipping the HF examples (pip install transformers, or "
              "pip install -e \".[examples]\")")
        return {}
    device, dtype = _common.pick_device(args.dtype, args.device)
    out = {}
    for kind in args.model:
        print(f"== {kind}")
        result, c = run_model(kind, args, device, dtype)
        name = NAMES[kind]
        per_model = argparse.Namespace(**vars(args))  # with several models: one PNG / JSON each
        if len(args.model) > 1:
            for key, ext in (("plot", ".png"), ("json", ".json")):
                if getattr(args, key):
                    root, given = os.path.splitext(getattr(args, key))
                    setattr(per_model, key, f"{root}_{kind}{given or ext}")
        out[kind] = _common.finish(name, result, per_model, device, dtype, c)
    return out


if __name__ == "__main__":
    main()
