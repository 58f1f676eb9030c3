"""Making a cache: `topkd cache build`'s settings and orchestration (resume, parts, the lock), the teacher
engines and the teacher's chunked lm_head -> rows, and whether a tokenizer matches the teacher's. Imports the
format, never topkd.cache.reading. `build` and `CacheBuildConfig` are topkd.cache's; the teacher-side names
below are public for tools that time the teacher's head themselves (topkd bench cache), and the served teacher."""

from topkd.cache.building.served import ServedTeacher
from topkd.cache.building.teacher import HEAD_CHUNK_BYTES, head_topk, load_teacher, split_rows

__all__ = ["HEAD_CHUNK_BYTES", "ServedTeacher", "head_topk", "load_teacher", "split_rows"]
