"""``python -m train sample PATH --prompt TEXT``: text from a trained language model.

PATH is a run of this framework, an export of one, or a Hugging Face directory
(:mod:`train.serving.source`). Prints each row's text (the prompt and what follows it),
then one line: tokens/s, time to the first token, the weights' and the cache's bytes.
Exit status: 0 done, 2 bad input (one line on stderr; nothing computed).
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["USAGE", "main"]

USAGE = ("python -m train sample RUN [--prompt TEXT | --prompt-file F] [--tokens N] [--temperature T] [--top-k K] "
         "[--top-p P] [--seed S] [--batch B] [--dtype bf16|f16|f32|int8|nf4] [--kv-dtype bf16|f16|int8|fp8] "
         "[--decode-kernels xla|fused] [--diagnose]")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m train sample", usage=USAGE,
        description="Generate text from RUN (a workdir of this framework, an export of one, or a Hugging Face "
                    "directory with its tokenizer): its weights in DTYPE (the run's float32 islands kept; int8: "
                    "weight-only, a scale per output channel; nf4: a QLoRA run's base codes and unmerged adapters), "
                    "a KV cache in KV_DTYPE, the prompt in one compiled pass and each token in one compiled step, "
                    "sampling in float32 (docs/serving.md).")
    parser.add_argument("run", metavar="RUN", help="a run's workdir, an export, or a Hugging Face directory")
    prompt = parser.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", metavar="TEXT", default=None,
                        help="the text to continue (default: a newline; a vocabulary without one: its first character)")
    prompt.add_argument("--prompt-file", metavar="F", help="a UTF-8 file holding the text to continue")
    parser.add_argument("--tokens", type=int, default=200, metavar="N", help="new tokens per row (default 200)")
    parser.add_argument("--temperature", type=float, default=0.8, metavar="T",
                        help="divides the logits before sampling; 0 is greedy (default 0.8)")
    parser.add_argument("--top-k", type=int, metavar="K", help="sample among the K likeliest tokens only")
    parser.add_argument("--top-p", type=float, metavar="P",
                        help="sample among the fewest likeliest tokens whose probability reaches P")
    parser.add_argument("--seed", type=int, default=0, metavar="S", help="the sampling seed (default 0)")
    parser.add_argument("--batch", type=int, default=1, metavar="B", help="rows sampled at once (default 1)")
    parser.add_argument("--dtype", default="bf16", metavar="DTYPE",
                        help="the weights: bf16 (default), f16, f32, int8; nf4: a run fine-tuned on an nf4 base "
                             "(QLoRA), as it stored it")
    parser.add_argument("--kv-dtype", metavar="KV_DTYPE",
                        help="the KV cache: bf16, f16, int8, fp8 (int8/fp8: a scale per head and position; "
                             "default: the dtype the model computes in)")
    parser.add_argument("--no-cache", action="store_true",
                        help="decode without a KV cache (the whole prefix each token), to compare")
    parser.add_argument("--no-window", action="store_true",
                        help="refuse --tokens past the model's context instead of sliding the window")
    parser.add_argument("--decode-kernels", default="xla", choices=("xla", "fused"),
                        help="each new token through the model's own modules compiled by XLA (default), or, for a "
                             "Hugging Face Llama-family or GPT-2 model on a GPU, through five fused kernels a layer "
                             "(docs/serving.md)")
    parser.add_argument("--diagnose", action="store_true",
                        help="also run the numerics doctor on the prefill and a decode step in DTYPE / KV_DTYPE: "
                             "what overflows only there, with the verified rule")
    return parser


def main(argv: list[str]) -> int:
    """Parses ``sample``'s command line, generates, prints; returns the exit status."""
    args = _parser().parse_args(argv)
    from train.serving.generation import Generator  # heavy imports (jax) only past the parser
    from train.serving.sampling import Sampling
    from train.serving.tokenizer import SampleError

    try:
        text = _prompt(args)
        generator = Generator(args.run, args.dtype, args.kv_dtype, cache=not args.no_cache,
                              decode_kernels=args.decode_kernels)
        text = generator.source.tokenizer.default_prompt if text is None else text
        sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
        out = generator.generate(text, args.tokens, sampling, args.batch, window=not args.no_window)
        diagnosis = _diagnose(generator, text) if args.diagnose else None
    except SampleError as e:
        return _fail(str(e))
    for i, row in enumerate(out.texts):
        print(("" if i == 0 else "---\n") + row)
    print(out.end_line())
    if diagnosis is not None:
        print(diagnosis)
    return 0


def _prompt(args: argparse.Namespace) -> str | None:
    from train.serving.tokenizer import SampleError

    if args.prompt_file is None:
        return args.prompt  # None: the tokenizer's default
    try:
        with open(args.prompt_file, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError as e:
        raise SampleError(f"--prompt-file {args.prompt_file}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise SampleError(f"--prompt-file {args.prompt_file}: {e.strerror or e}") from None


def _diagnose(generator, text: str) -> str:
    from train.serving.diagnose import diagnose_decoding, format_diagnosis

    return format_diagnosis(diagnose_decoding(generator, text))


def _fail(message: str) -> int:
    print("error: " + " ".join(line.strip() for line in message.splitlines()), file=sys.stderr)
    return 2
