"""Using a cache: TopKCache (validated random access, student checks), TopKDataset and EpochSampler, `cache
verify` / `cache inspect`, and `cache export` / `cache import` (Axolotl's KD Parquet). Imports the format and
the building side (the teacher tokenizer checks, load_teacher for --init-from-teacher). Its public names are
topkd.cache's."""
