"""Trains the built-in models: a small OPTForCausalLM, or (--family llama) a small
LlamaForCausalLM with grouped-query attention (HF transformers, PyTorch), on the corpus of
tools/make_corpus.py, and exports it as the fp16 checkpoint the engine ships.

Steps (each resumable; see docs/builtin-model.md):
    python tools/make_corpus.py --out build/corpus
    python tools/train_tokenizer.py --corpus build/corpus/train.txt --out-dir build/tokenizer \\
        --vocab-size 8192
    python tools/train_model.py measure --corpus build/corpus --tokenizer build/tokenizer
    nice python tools/train_model.py train --corpus build/corpus --tokenizer build/tokenizer \\
        --run build/train-opt              # again with the same --run to resume
    python tools/train_model.py export --run build/train-opt --out models/builtin

Training data: every training document is tokenized whole (BOS = </s>, id 2, before each, as the
engine does for a prompt) and the documents are concatenated. An example is BOS followed by
context - 1 tokens of that stream, starting at a document's first token half of the time (so the
model sees positions from the start of a text, as a prompt gives them) and at a uniformly random
token otherwise. Examples are drawn from a generator seeded by the step, so a resumed run sees
the same examples as an uninterrupted one.

With --retrieval-share P, that share of the micro-batches are passkey retrieval examples instead
(tools/passkey_examples.py: the prompt `infinigen eval --task passkey` builds, filler from the
training stream, a random depth, a length log-uniform up to the context, one length per
micro-batch and as many examples as fill its tokens), trained on their answer's tokens and the
needle's repeat of the key only; the retrieval of the model is then measured at every
evaluation too. With --init, a run starts from an exported checkpoint of the same shape (to teach
a shipped model retrieval without training it again from scratch).

Held-out perplexity is measured on the held-out documents (never trained on): every document of
at least one context is read from its start in non-overlapping windows of one context, each
window starting with BOS; the mean negative log-likelihood of all predicted tokens gives it.
"""

import argparse
import json
import math
import os
import pathlib
import shutil
import sys
import time

import numpy as np
import torch
from tokenizers import ByteLevelBPETokenizer
from transformers import LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM

from passkey_examples import PasskeyExamples, greedy_key_accuracy

BOS_ID, PAD_ID, EOS_ID = 2, 1, 2  # OPT's conventions, kept by tools/train_tokenizer.py
MODEL_CLASSES = {"opt": OPTForCausalLM, "llama": LlamaForCausalLM}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# ---------------------------------------------------------------------------------------------
# Data


def load_tokenizer(directory: pathlib.Path) -> ByteLevelBPETokenizer:
    vocab, merges = directory / "vocab.json", directory / "merges.txt"
    for path in (vocab, merges):
        if not path.is_file():
            sys.exit(f"train_model: {path} is missing (run tools/train_tokenizer.py)")
    return ByteLevelBPETokenizer(str(vocab), str(merges))


def tokenized_split(corpus: pathlib.Path, tokenizer_dir: pathlib.Path, split: str,
                    cache_dir: pathlib.Path) -> tuple[np.ndarray, np.ndarray]:
    """Returns (tokens, document starts) of a split: uint16 ids, each document BOS first."""
    cache = cache_dir / f"tokens-{split}.npz"
    source = corpus / f"{split}.jsonl"
    if not source.is_file():
        sys.exit(f"train_model: {source} is missing (run tools/make_corpus.py)")
    if cache.is_file() and cache.stat().st_mtime >= source.stat().st_mtime:
        data = np.load(cache)
        return data["tokens"], data["starts"]
    tokenizer = load_tokenizer(tokenizer_dir)
    documents = [json.loads(line)["text"] for line in source.open(encoding="utf-8")]
    encoded = tokenizer.encode_batch(documents)
    pieces, starts, offset = [], [], 0
    for item in encoded:
        ids = np.asarray([BOS_ID] + item.ids, dtype=np.uint16)
        starts.append(offset)
        pieces.append(ids)
        offset += len(ids)
    tokens = np.concatenate(pieces)
    cache_dir.mkdir(parents=True, exist_ok=True)
    np.savez(cache, tokens=tokens, starts=np.asarray(starts, dtype=np.int64))
    log(f"{split}: {len(documents)} documents, {len(tokens)} tokens")
    return tokens, np.asarray(starts, dtype=np.int64)


def training_batch(tokens: np.ndarray, starts: np.ndarray, rows: int, context: int,
                   seed: int) -> torch.Tensor:
    """(rows, context) int64: BOS then context - 1 tokens of the stream per row."""
    rng = np.random.default_rng(seed)
    body = context - 1
    batch = np.empty((rows, context), dtype=np.int64)
    batch[:, 0] = BOS_ID
    last_start = len(tokens) - body
    for row in range(rows):
        if rng.random() < 0.5:
            # A document's first token (skipping its own BOS), or the nearest valid offset.
            start = min(int(starts[rng.integers(len(starts))]) + 1, last_start)
        else:
            start = int(rng.integers(0, last_start))
        batch[row, 1:] = tokens[start:start + body]
    return torch.from_numpy(batch)


def heldout_windows(tokens: np.ndarray, starts: np.ndarray, context: int) -> list[np.ndarray]:
    """Non-overlapping windows of one context from the start of each long held-out document."""
    ends = list(starts[1:]) + [len(tokens)]
    windows = []
    for start, end in zip(starts, ends):
        document = tokens[start + 1:end]  # without its BOS
        body = context - 1
        for offset in range(0, len(document) - body + 1, body):
            windows.append(np.concatenate([[BOS_ID], document[offset:offset + body]]))
    return windows


@torch.no_grad()
def heldout_perplexity(model: torch.nn.Module, windows: list[np.ndarray], rows: int) -> float:
    model.eval()
    total_nll, total_tokens = 0.0, 0
    for first in range(0, len(windows), rows):
        batch = torch.from_numpy(np.stack(windows[first:first + rows]).astype(np.int64))
        batch = batch.to(model.device)
        logits = model(input_ids=batch).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum")
        total_nll += nll.item()
        total_tokens += batch[:, 1:].numel()
    model.train()
    return math.exp(total_nll / total_tokens)


# ---------------------------------------------------------------------------------------------
# Model and schedule


def model_config(args: argparse.Namespace, vocab_size: int):
    common = dict(vocab_size=vocab_size, hidden_size=args.hidden, num_hidden_layers=args.layers,
                  num_attention_heads=args.heads, max_position_embeddings=args.context,
                  pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                  tie_word_embeddings=True)
    if getattr(args, "family", "opt") == "llama":
        # Llama-3-like: RMSNorm, SwiGLU, RoPE, grouped-query attention, no biases; the LM head
        # tied to the embedding, as small Llama-family models do.
        return LlamaConfig(**common, intermediate_size=args.ffn,
                           num_key_value_heads=args.kv_heads or args.heads, rms_norm_eps=1e-5,
                           rope_theta=10000.0, hidden_act="silu", attention_bias=False,
                           mlp_bias=False, attention_dropout=0.0)
    return OPTConfig(**common, ffn_dim=args.ffn, word_embed_proj_dim=args.hidden,
                     do_layer_norm_before=True, activation_function="relu", enable_bias=True,
                     layer_norm_elementwise_affine=True, dropout=args.dropout,
                     attention_dropout=0.0)


def learning_rate(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak at --total-steps."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = min(1.0, (step - args.warmup_steps) / max(1, args.total_steps - args.warmup_steps))
    return args.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def new_model(args: argparse.Namespace, vocab_size: int):
    return MODEL_CLASSES[getattr(args, "family", "opt")](model_config(args, vocab_size))


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--family", choices=sorted(MODEL_CLASSES), default="opt")
    parser.add_argument("--kv-heads", type=int, default=0,
                        help="llama: key/value heads (grouped-query attention; 0: as --heads)")
    parser.add_argument("--corpus", type=pathlib.Path, default=pathlib.Path("build/corpus"))
    parser.add_argument("--tokenizer", type=pathlib.Path, default=pathlib.Path("build/tokenizer"))
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--ffn", type=int, default=1536)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per forward pass")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="PyTorch device to train on (default: cuda when PyTorch sees one)")


# ---------------------------------------------------------------------------------------------
# Commands


def save_checkpoint(run: pathlib.Path, state: dict) -> None:
    """Writes run/checkpoint.pt atomically: a kill during the save leaves the previous one."""
    temporary = run / "checkpoint.pt.tmp"
    torch.save(state, temporary)
    with open(temporary, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(temporary, run / "checkpoint.pt")


def command_train(args: argparse.Namespace) -> int:
    longest = args.retrieval_max_length or args.context - 8
    if args.retrieval_share > 0 and not 16 <= args.retrieval_min_length <= longest <= args.context - 8:
        sys.exit(f"train_model: passkey prompts of {args.retrieval_min_length} to {longest} tokens "
                 f"do not fit a context of {args.context} (16 at least, the context less 8 at most)")
    torch.set_num_threads(args.threads)
    run: pathlib.Path = args.run
    run.mkdir(parents=True, exist_ok=True)
    settings_path = run / "settings.json"
    settings = {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items()
                if k not in ("command", "handler", "run", "threads", "device", "total_steps")}
    if settings_path.is_file():
        saved = json.loads(settings_path.read_text())
        changed = {k: (saved.get(k), v) for k, v in settings.items()
                   if k in ("family", "kv_heads", "layers", "hidden", "heads", "ffn", "context")
                   and saved.get(k, {"family": "opt", "kv_heads": 0}.get(k)) != v}
        if changed:
            sys.exit(f"train_model: {run} was started with other shapes: {changed}")
        # A resumed run continues what its first call started from (--init): the card names it.
        if settings.get("init") is None:
            settings["init"] = saved.get("init")
    settings_path.write_text(json.dumps(settings, indent=2) + "\n")

    train_tokens, train_starts = tokenized_split(args.corpus, args.tokenizer, "train", run)
    held_tokens, held_starts = tokenized_split(args.corpus, args.tokenizer, "heldout", run)
    windows = heldout_windows(held_tokens, held_starts, args.context)[: args.eval_windows]
    vocab_size = len(json.loads((args.tokenizer / "vocab.json").read_text()))
    rows_per_step = max(1, args.batch_tokens // args.context)
    accumulation = max(1, rows_per_step // args.micro_batch)
    args.total_steps = args.max_tokens // (accumulation * args.micro_batch * args.context)

    torch.manual_seed(args.seed)
    model = new_model(args, vocab_size).to(args.device)
    if args.init and not (run / "checkpoint.pt").is_file():
        initial = MODEL_CLASSES[args.family].from_pretrained(args.init, dtype=torch.float32)
        try:
            model.load_state_dict(initial.state_dict())
        except RuntimeError as error:
            sys.exit(f"train_model: --init {args.init} does not have this run's shapes: "
                     f"{str(error).splitlines()[0]}")
        log(f"starting from {args.init}")
    retrieval = None
    if args.retrieval_share > 0:
        retrieval = PasskeyExamples(load_tokenizer(args.tokenizer), train_tokens, BOS_ID,
                                    word_share=args.retrieval_word_share)
        # Watched at each evaluation: 2 keys at each of 3 depths and 3 lengths up to the context.
        retrieval_lengths = [256, args.context // 2, args.context - 8]
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95))
    step, tokens_seen, history, best = 0, 0, [], float("inf")
    checkpoint = run / "checkpoint.pt"
    if checkpoint.is_file():
        state = torch.load(checkpoint, weights_only=False, map_location=args.device)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step, tokens_seen = state["step"], state["tokens_seen"]
        history, best = state["history"], state["best_heldout_ppl"]
        log(f"resumed at step {step} ({tokens_seen / 1e6:.1f} M tokens)")
    parameters = sum(p.numel() for p in model.parameters())
    log(f"{parameters / 1e6:.2f} M parameters; {accumulation} x {args.micro_batch} sequences of "
        f"{args.context} per step; {args.total_steps} steps planned; "
        f"{len(windows)} held-out windows")

    model.train()
    log_file = open(run / "train_log.jsonl", "a", encoding="utf-8")
    started = time.time()
    while step < args.total_steps:
        lr = learning_rate(step, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for micro in range(accumulation):
            seed = args.seed * 1_000_003 + step * accumulation + micro
            choice = np.random.default_rng([seed, 1])
            if retrieval is not None and choice.random() < args.retrieval_share:
                # The answer (at most 8 tokens) after the prompt stays within the context.
                # Log-uniform: short examples teach the copy fast, long ones its reach.
                longest = args.retrieval_max_length or args.context - 8
                length = int(round(math.exp(choice.uniform(math.log(args.retrieval_min_length),
                                                           math.log(longest)))))
                # As many examples as fit the micro-batch's tokens: short ones come many at once.
                rows = max(args.micro_batch, args.micro_batch * args.context // length)
                ids, labels = retrieval.batch(rows, length, seed, args.retrieval_edge_share)
                batch = torch.from_numpy(ids).to(args.device)
                labels = torch.from_numpy(labels).to(args.device)
            else:
                batch = training_batch(train_tokens, train_starts, args.micro_batch, args.context,
                                       seed).to(args.device)
                labels = batch
            loss = model(input_ids=batch, labels=labels).loss / accumulation
            loss.backward()
            loss_sum += loss.item()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
        optimizer.step()
        step += 1
        tokens_seen += accumulation * args.micro_batch * args.context
        record = {"step": step, "tokens": tokens_seen, "lr": lr, "loss": loss_sum,
                  "grad_norm": grad_norm,
                  "tokens_per_s": tokens_seen and (accumulation * args.micro_batch * args.context)
                  / max(1e-9, time.time() - started)}
        started = time.time()
        if step % args.eval_every == 0 or step == args.total_steps:
            record["heldout_ppl"] = heldout_perplexity(model, windows, args.micro_batch)
            history.append({"step": step, "tokens": tokens_seen, "ppl": record["heldout_ppl"]})
            best = min(best, record["heldout_ppl"])
            found = ""
            if retrieval is not None:
                accuracy = greedy_key_accuracy(model, retrieval, retrieval_lengths,
                                               [0.0, 0.5, 1.0], 2, seed=12345)
                record["passkey"] = history[-1]["passkey"] = accuracy["overall"]
                found = f", passkey {accuracy['overall']:.0%} {accuracy['per_length']}"
            log(f"step {step}: loss {loss_sum:.3f}, held-out perplexity "
                f"{record['heldout_ppl']:.2f} (best {best:.2f}){found}, "
                f"{tokens_seen / 1e6:.1f} M tokens")
        log_file.write(json.dumps(record) + "\n")
        log_file.flush()
        if step % args.save_every == 0 or step == args.total_steps or "heldout_ppl" in record:
            save_checkpoint(run, {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                  "step": step, "tokens_seen": tokens_seen, "history": history,
                                  "best_heldout_ppl": best})
            if "heldout_ppl" in record and record["heldout_ppl"] <= best:
                shutil.copyfile(run / "checkpoint.pt", run / "best.pt")
        if plateaued(history, args.patience, args.min_improvement):
            log(f"held-out perplexity improved less than {args.min_improvement:.1%} over the "
                f"last {args.patience} evaluations: stopping")
            break
    log(f"done at step {step}, {tokens_seen / 1e6:.1f} M tokens, best held-out perplexity "
        f"{best:.2f}")
    return 0


def plateaued(history: list[dict], patience: int, min_improvement: float) -> bool:
    if len(history) <= patience:
        return False
    before = min(h["ppl"] for h in history[:-patience])
    recent = min(h["ppl"] for h in history[-patience:])
    return recent > before * (1.0 - min_improvement)


def command_measure(args: argparse.Namespace) -> int:
    """Times a few optimizer steps of the given shape (tokens per second)."""
    torch.set_num_threads(args.threads)
    vocab_size = len(json.loads((args.tokenizer / "vocab.json").read_text()))
    model = new_model(args, vocab_size).to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randint(4, vocab_size, (args.micro_batch, args.context), device=args.device)
    times = []
    for _ in range(args.steps):
        start = time.time()
        optimizer.zero_grad()
        model(input_ids=batch, labels=batch).loss.backward()
        optimizer.step()
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.time() - start)
    median = sorted(times[1:])[len(times[1:]) // 2]
    parameters = sum(p.numel() for p in model.parameters())
    print(f"layers {args.layers} hidden {args.hidden} heads {args.heads} ffn {args.ffn} "
          f"context {args.context}: {parameters / 1e6:.2f} M parameters, "
          f"{args.micro_batch * args.context / median:.0f} tokens/s (median of {len(times) - 1})")
    return 0


def command_export(args: argparse.Namespace) -> int:
    """Writes the best checkpoint of a run as an fp16 HF checkpoint with tokenizer and card."""
    run: pathlib.Path = args.run
    settings = json.loads((run / "settings.json").read_text())
    namespace = argparse.Namespace(**settings)
    tokenizer_dir = pathlib.Path(settings["tokenizer"])
    vocab_size = len(json.loads((tokenizer_dir / "vocab.json").read_text()))
    state = torch.load(run / ("best.pt" if args.which == "best" else "checkpoint.pt"),
                       weights_only=False, map_location="cpu")
    model = new_model(namespace, vocab_size)
    model.load_state_dict(state["model"])
    if isinstance(model.config, OPTConfig):
        model.config.dropout = 0.0
    model = model.half().eval()

    staging = args.out.with_name(args.out.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging, safe_serialization=True)
    (staging / "model.safetensors").chmod(0o644)
    # Sampling by default: a model this small repeats itself under greedy decoding.
    generation = {"do_sample": True, "temperature": args.temperature, "top_p": args.top_p,
                  "bos_token_id": model.config.bos_token_id,
                  "eos_token_id": model.config.eos_token_id,
                  "pad_token_id": model.config.pad_token_id}
    (staging / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    for name in ("vocab.json", "merges.txt"):
        shutil.copyfile(tokenizer_dir / name, staging / name)

    # Held-out perplexity of the exported fp16 weights, as HF transformers computes it in fp32.
    check = MODEL_CLASSES[getattr(namespace, "family", "opt")].from_pretrained(
        staging, dtype=torch.float32).eval()
    held_tokens, held_starts = tokenized_split(pathlib.Path(settings["corpus"]), tokenizer_dir,
                                               "heldout", run)
    windows = heldout_windows(held_tokens, held_starts, namespace.context)
    ppl = heldout_perplexity(check, windows, namespace.micro_batch)
    manifest = json.loads((pathlib.Path(settings["corpus"]) / "manifest.json").read_text())
    card = {
        "parameters": sum(p.numel() for p in check.parameters()),
        "vocab_size": vocab_size,
        "tokens_seen": state["tokens_seen"],
        "steps": state["step"],
        "heldout_perplexity_fp16_weights": round(ppl, 3),
        "heldout_windows": len(windows),
        "history": state["history"],
        "corpus_packages": manifest["packages"],
        "settings": settings,
    }
    (staging / "training.json").write_text(json.dumps(card, indent=2) + "\n")
    (staging / "README.md").write_text(model_card(card, generation))
    shutil.rmtree(args.out, ignore_errors=True)
    staging.rename(args.out)
    log(f"wrote {args.out}: held-out perplexity {ppl:.2f} over {len(windows)} windows "
        f"(fp16 weights, HF transformers)")
    return 0


def model_card(card: dict, generation: dict) -> str:
    """The checkpoint's README: what it is, what it was trained on, how well it does."""
    s = card["settings"]
    packages = ", ".join(f"`{name}` {version}" for name, version in card["corpus_packages"].items())
    history = "\n".join(f"| {h['step']} | {h['tokens'] / 1e6:.1f} M | {h['ppl']:.1f} |"
                        for h in card["history"])
    llama = s.get("family", "opt") == "llama"
    kind = "LlamaForCausalLM" if llama else "OPTForCausalLM"
    architecture = (f"Llama (RMSNorm, SwiGLU, RoPE), {s['layers']} layers, hidden {s['hidden']}, "
                    f"{s['heads']} query heads sharing {s['kv_heads']} key/value "
                    f"head{'s' if s['kv_heads'] != 1 else ''}, FFN "
                    f"{s['ffn']}, LM head tied to the embedding" if llama else
                    f"OPT, pre-LayerNorm, {s['layers']} layers, hidden {s['hidden']}, "
                    f"{s['heads']} heads, FFN {s['ffn']}")
    use = ("`--model builtin-llama` names it: the engine's rotary, grouped-query path on attention "
           "that learned language." if llama else
           "It is what `infinigen run` and `infinigen eval` use when no `--model` is given.")
    # A run that continued another checkpoint (--init) says which, and how much that one had seen.
    origin, before = "trained from scratch", ""
    if s.get("init"):
        prior = pathlib.Path(s["init"]) / "training.json"
        prior_tokens = json.loads(prior.read_text())["tokens_seen"] if prior.is_file() else None
        origin = f"continued from the checkpoint that `{s['init']}` held when its training began"
        if prior_tokens:
            before = f", after the {prior_tokens / 1e6:.1f} M of the checkpoint it continued"
    retrieval = ""
    if s.get("retrieval_share", 0) > 0:
        retrieval = (f" Its training mixed in passkey retrieval examples ({s['retrieval_share']:.0%}"
                     " of the micro-batches in its last phase: a key hidden in the text and asked "
                     "for at the end, `tools/passkey_examples.py`), so that it finds one token far "
                     "back (`infinigen eval --task passkey`, `docs/accuracy.md`).")
    return f"""# The built-in {"Llama " if llama else ""}model

A small `{kind}` {origin} with `tools/train_model.py` on real English that
Debian packages ship ({packages}): the reStructuredText sources of the Python documentation and
the King James Bible, documents kept whole. {use} It writes English-like text; it knows little and makes no sense for
long. It exists so that the engine, and InfiniGen's choice of KV entries, are judged on attention
that learned language rather than on random weights.{retrieval}

| | |
|---|---|
| architecture | {architecture} |
| context | {s['context']} tokens |
| parameters | {card['parameters'] / 1e6:.2f} M |
| vocabulary | {card['vocab_size']} tokens, byte-level BPE trained on the same corpus (`tools/train_tokenizer.py`) |
| tokens seen | {card['tokens_seen'] / 1e6:.1f} M ({card['steps']} steps of {s['batch_tokens']} tokens{before}) |
| held-out perplexity | {card['heldout_perplexity_fp16_weights']:.1f} (HF transformers, these fp16 weights, {card['heldout_windows']} windows of {s['context']} tokens from documents never trained on) |
| weights | fp16 safetensors |
| sampling default | temperature {generation['temperature']}, top-p {generation['top_p']} (`generation_config.json`) |

Held-out perplexity during training (the first 48 windows, fp32 weights):

| step | tokens | perplexity |
|---:|---:|---:|
{history}

Rebuild it (hours on two cores): `tools/make_corpus.py`, `tools/train_tokenizer.py`, then
`tools/train_model.py train` and `export` with the settings in `training.json`; see
`docs/builtin-model.md`.
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    train = commands.add_parser("train", help="train, or resume, a run")
    add_model_arguments(train)
    train.add_argument("--run", type=pathlib.Path, required=True, help="run directory")
    train.add_argument("--batch-tokens", type=int, default=16384, help="tokens per optimizer step")
    train.add_argument("--max-tokens", type=int, default=60_000_000)
    train.add_argument("--lr", type=float, default=1e-3)
    train.add_argument("--warmup-steps", type=int, default=200)
    train.add_argument("--weight-decay", type=float, default=0.1)
    train.add_argument("--eval-every", type=int, default=100, help="steps between evaluations")
    train.add_argument("--eval-windows", type=int, default=48)
    train.add_argument("--save-every", type=int, default=25)
    train.add_argument("--patience", type=int, default=4)
    train.add_argument("--min-improvement", type=float, default=0.005)
    train.add_argument("--seed", type=int, default=1)
    train.add_argument("--init", type=pathlib.Path, default=None,
                       help="exported checkpoint of the same shape to start from")
    train.add_argument("--retrieval-share", type=float, default=0.0,
                       help="share of micro-batches that are passkey retrieval examples")
    train.add_argument("--retrieval-min-length", type=int, default=64,
                       help="shortest passkey prompt, in tokens")
    train.add_argument("--retrieval-max-length", type=int, default=0,
                       help="longest passkey prompt, in tokens (0: the context less 8); a run "
                            "can start short, where the copy is learnt fast, and resume longer")
    train.add_argument("--retrieval-word-share", type=float, default=0.25,
                       help="share of passkey examples whose key is a word (the others: five "
                            "digits)")
    train.add_argument("--retrieval-edge-share", type=float, default=0.0,
                       help="share of passkey examples with the key at the prompt's start or end "
                            "(depth 0 or 1), the others at a uniform depth")
    train.set_defaults(handler=command_train)

    measure = commands.add_parser("measure", help="time training steps of one shape")
    add_model_arguments(measure)
    measure.add_argument("--steps", type=int, default=4)
    measure.set_defaults(handler=command_measure)

    export = commands.add_parser("export", help="write a run's best checkpoint for the engine")
    export.add_argument("--run", type=pathlib.Path, required=True)
    export.add_argument("--out", type=pathlib.Path, required=True)
    export.add_argument("--which", choices=["best", "last"], default="best",
                        help="the weights of the best held-out perplexity, or the last saved "
                        "(a retrieval run trades a little perplexity for retrieval)")
    export.add_argument("--temperature", type=float, default=0.8,
                        help="sampling temperature written to generation_config.json")
    export.add_argument("--top-p", type=float, default=0.95,
                        help="nucleus mass written to generation_config.json")
    export.set_defaults(handler=command_export)

    args = parser.parse_args()
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
