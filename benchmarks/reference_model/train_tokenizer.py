"""Train the reference model's byte-level BPE tokenizer (vocab 8192) and pre-tokenize the corpus.

Usage (run from the repository root, CPU only):

    python benchmarks/reference_model/train_tokenizer.py \
        --train ../shared/data/wiki_en_train.txt.xz --val ../shared/data/wiki_en_val.txt.xz \
        --out quantmla_hf/assets/reference_model --tokens-dir .refdata --sample-mb 60

Writes tokenizer.json / tokenizer_config.json / special_tokens_map.json into --out (a
transformers PreTrainedTokenizerFast) and, into --tokens-dir, the token ids of the whole train and
val texts as flat np.uint16 files (train.bin, val.bin). Articles are separated by '\n\n\n' in the
corpus; each article is encoded on its own and followed by the <|endoftext|> token (id 0), which
is the model's bos/eos token, GPT-2 style.
"""
import argparse
import lzma
import os
import time

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

EOT = "<|endoftext|>"
PAD = "<|pad|>"


def read_articles(path):
    opener = lzma.open if path.endswith(".xz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        text = f.read()
    return [a.strip("\n") for a in text.split("\n\n\n") if a.strip()]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--val", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens-dir", required=True)
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--sample-mb", type=float, default=60.0,
                    help="MB of training text (leading articles) used to learn the BPE merges")
    args = ap.parse_args()

    t0 = time.time()
    train_articles = read_articles(args.train)
    val_articles = read_articles(args.val)
    print(f"read {len(train_articles)} train / {len(val_articles)} val articles in {time.time()-t0:.1f}s", flush=True)

    # BPE merges are learned on a leading sample of the (already shuffled) training articles.
    budget, sample = int(args.sample_mb * 1e6), []
    for a in train_articles:
        if budget <= 0:
            break
        sample.append(a)
        budget -= len(a.encode("utf-8"))
    print(f"learning merges on {len(sample)} articles (~{args.sample_mb} MB)", flush=True)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab_size,
        min_frequency=2,
        special_tokens=[EOT, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    t1 = time.time()
    tok.train_from_iterator(sample, trainer=trainer, length=len(sample))
    print(f"BPE trained in {time.time()-t1:.1f}s, vocab {tok.get_vocab_size()}", flush=True)

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOT,
        eos_token=EOT,
        unk_token=None,
        pad_token=PAD,
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    os.makedirs(args.out, exist_ok=True)
    fast.save_pretrained(args.out)

    eot_id = tok.token_to_id(EOT)
    assert eot_id == 0 and tok.token_to_id(PAD) == 1
    os.makedirs(args.tokens_dir, exist_ok=True)
    for name, arts in (("val", val_articles), ("train", train_articles)):
        t2 = time.time()
        n_bytes = sum(len(a.encode("utf-8")) for a in arts)
        chunks, n = [], 0
        step = 2000
        for i in range(0, len(arts), step):
            encs = tok.encode_batch(arts[i:i + step], add_special_tokens=False)
            for e in encs:
                ids = np.asarray(e.ids + [eot_id], dtype=np.uint16)
                chunks.append(ids)
                n += len(ids)
        arr = np.concatenate(chunks)
        assert arr.max() < args.vocab_size
        arr.tofile(os.path.join(args.tokens_dir, f"{name}.bin"))
        print(f"{name}: {len(arts)} articles, {n_bytes} bytes -> {n} tokens "
              f"({n_bytes / n:.2f} bytes/token) in {time.time()-t2:.1f}s", flush=True)
    print(f"total {time.time()-t0:.1f}s")


if __name__ == "__main__":
    main()
