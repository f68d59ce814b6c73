"""`model.name: hf`: Hugging Face causal LMs (Llama, Qwen2, Mistral, GPT-2) under every raydl parallelism.

    pip install "raydl[hf]"
    raydl train --set model.name=hf --set model.options.family=llama --set model.options.layers=4 \\
                --set data.path=my_tokens --set parallel.pp_degree=2
    raydl export runs/<run> --format hf --out my_model      # then AutoModelForCausalLM.from_pretrained

- options.py: `model.options` (torch-free, for `raydl train --help`)
- config.py: options + dataset meta -> a transformers config, from local files only
- blocks.py: the model cut into blocks embed, h0.., head, so FSDP2, every pipeline schedule, the
  planner, activation checkpointing and layout-agnostic checkpoints apply as to raydl's own gpt
- model.py: the ModelSpec (`raydl.models.hf.model.spec`) and `HfBlocks`, what a worker needs to build the
  model on meta and materialize only its own part (transformers' init per module, or the weights)
- weights.py: model.options.weights, headers checked before any worker starts, read per rank by slice
  (docs/large-models.md)

Tied embeddings (GPT-2, and any config with tie_word_embeddings): raydl trains the head as its
own parameter, starting as a copy of the input embeddings. In a pipeline the two sit on different
stages, where a shared parameter silently gets only part of its gradient; untying in every layout
keeps one parameter set for every layout, so checkpoints still move between layouts. Export
writes tie_word_embeddings=false.
"""
