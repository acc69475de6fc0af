"""A tiny Whisper built offline: a real Whisper architecture and processor at toy size.

It is trained for a few seconds to say one phrase for any audio (it may say it more than once:
it is not trained to stop), so a test can check the whole speech path (audio decoded from a file,
log-mel features, encoder-decoder generation, detokenisation) against a known answer. It does
not recognise speech.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from closedloop.models.tiny import token_id

TINY_ASR_FILE = "closedloop_tiny_asr.json"
_SPECIALS = ["<|endoftext|>", "<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|translate|>",
             "<|nocaptions|>", "<|notimestamps|>", "<|startofprev|>", "<|startoflm|>"]


def build_tiny_asr(path: str | Path, *, phrase: str = "hello world", steps: int = 60, seed: int = 0) -> Path:
    import numpy as np
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (GenerationConfig, WhisperConfig, WhisperFeatureExtractor,
                              WhisperForConditionalGeneration, WhisperProcessor, WhisperTokenizer)

    path = Path(path)
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    torch.manual_seed(seed)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([phrase, " " + phrase, "a tiny speech model"] * 20,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=_SPECIALS,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.save(str(path / "tokenizer.json"))
    tok = WhisperTokenizer(tokenizer_file=str(path / "tokenizer.json"), unk_token="<|endoftext|>",
                               bos_token="<|endoftext|>", eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                               additional_special_tokens=_SPECIALS[1:])
    ids = {t: token_id(tok, t) for t in _SPECIALS}
    processor = WhisperProcessor(feature_extractor=WhisperFeatureExtractor(feature_size=80), tokenizer=tok)
    cfg = WhisperConfig(vocab_size=len(tok), num_mel_bins=80, encoder_layers=1, decoder_layers=1,
                        encoder_attention_heads=2, decoder_attention_heads=2, d_model=32, encoder_ffn_dim=64,
                        decoder_ffn_dim=64, max_source_positions=1500, max_target_positions=64,
                        decoder_start_token_id=ids["<|startoftranscript|>"], eos_token_id=ids["<|endoftext|>"],
                        pad_token_id=ids["<|endoftext|>"], bos_token_id=ids["<|endoftext|>"],
                        begin_suppress_tokens=None, suppress_tokens=None)
    model = WhisperForConditionalGeneration(cfg)
    prefix = [ids["<|startoftranscript|>"], ids["<|en|>"], ids["<|transcribe|>"], ids["<|notimestamps|>"]]
    target = prefix + tok.encode(" " + phrase, add_special_tokens=False) + [ids["<|endoftext|>"]]
    labels = torch.tensor([target[1:]])
    decoder_in = torch.tensor([target[:-1]])
    rng = np.random.default_rng(seed)
    # A few sounds (noise, tones, silence), featurised once: feature extraction dominates the cost.
    sounds = [(rng.standard_normal(16_000) * a).astype(np.float32) for a in (0.01, 0.1, 0.5)]
    sounds += [(np.sin(np.arange(16_000) * f) * 0.3).astype(np.float32) for f in (0.01, 0.05, 0.2)]
    sounds.append(np.zeros(16_000, dtype=np.float32))
    feats = processor.feature_extractor(sounds, sampling_rate=16_000, return_tensors="pt").input_features
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):  # any sound -> the phrase
        loss = model(input_features=feats, decoder_input_ids=decoder_in.expand(len(sounds), -1),
                     labels=labels.expand(len(sounds), -1)).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    model.generation_config = GenerationConfig(
        decoder_start_token_id=ids["<|startoftranscript|>"], eos_token_id=ids["<|endoftext|>"],
        pad_token_id=ids["<|endoftext|>"], max_length=24, no_timestamps_token_id=ids["<|notimestamps|>"],
        lang_to_id={"<|en|>": ids["<|en|>"]}, is_multilingual=True,
        task_to_id={"transcribe": ids["<|transcribe|>"], "translate": ids["<|translate|>"]})
    model.save_pretrained(path)
    processor.save_pretrained(path)
    (path / TINY_ASR_FILE).write_text(json.dumps({"phrase": phrase, "steps": steps, "seed": seed,
                                                  "final_loss": float(loss.item())}, indent=2))
    return path
