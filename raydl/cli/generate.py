"""raydl generate: a trained model's answers to a prompt, or its exact match on held-out records (one process)."""

from __future__ import annotations

import json


def register(sub) -> None:
    p = sub.add_parser("generate", help="Answer a prompt with a trained run or an export, or score held-out "
                       "records by exact match (one process, no Ray).", description=__doc__)
    p.add_argument("source", metavar="RUN_OR_EXPORT", help="A run directory (its newest usable checkpoint), one of "
                   "its checkpoints, or a Hugging Face directory (raydl export --format hf, or save_pretrained) with "
                   "its tokenizer files.")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="The user's message (rendered with the chat template when the data used one).")
    what.add_argument("--eval", metavar="HELD_OUT.jsonl", help="Records (prompt-response, or chat whose last "
                      "assistant turn is the expected answer): prints their exact match, greedy.")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples from "
                   "softmax(logits / temperature). --eval is always greedy.")
    p.add_argument("--seed", type=int, default=0, help="Seed of the sampling (--temperature > 0).")
    p.add_argument("--max-new-tokens", type=int, default=64, help="Most tokens to generate (default 64); generation "
                   "stops earlier at the end-of-turn token.")
    p.add_argument("--limit", type=int, default=0, help="--eval: score only the first N records (0 = all).")
    p.add_argument("--template", choices=("auto", "chat", "none"), default="auto", help="Render prompts with the "
                   "tokenizer's chat template: auto (default) = when the run's data was chat records, or for an "
                   "export when its tokenizer has one.")
    p.add_argument("--tokenizer", metavar="DIR", help="Encode with this tokenizer directory (tokenizer.json + "
                   "tokenizer_config.json, of the same vocabulary) instead of the run's or export's: e.g. a run "
                   "pre-trained on text, scored with the chat template its fine-tuning uses (--template chat).")
    p.add_argument("--config", help="The run's config.yaml, when the checkpoint is not inside its run directory.")
    p.add_argument("--json", action="store_true", help="Print JSON.")
    p.set_defaults(func=run)


def run(args) -> int:
    from raydl.errors import ConfigError
    from raydl.generate import exact_match, load_generator

    if args.temperature < 0 or args.max_new_tokens <= 0:
        raise ConfigError("--temperature" if args.temperature < 0 else "--max-new-tokens",
                          "must be >= 0 (temperature) and > 0 (max new tokens)", "pass a value in range")
    generator = load_generator(args.source, config=args.config, template=args.template, tokenizer=args.tokenizer)
    if args.eval:
        result = exact_match(generator, args.eval, max_new_tokens=args.max_new_tokens, limit=args.limit)
        print(json.dumps(result, indent=1) if args.json else
              f"exact match {result['exact_match']:.1%} on {result['records']} records of {args.eval} "
              f"({result['ended_with_end_token']:.1%} ended with the end-of-turn token)")
        return 0
    answer = generator.answer(args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              seed=args.seed)
    print(json.dumps(vars(answer)) if args.json else answer.text)
    return 0
