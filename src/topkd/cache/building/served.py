"""A teacher behind an OpenAI-compatible completions server (`topkd train --teacher-url`): the same rows.

    teacher = ServedTeacher("http://gpu-box:8000/v1", tokenizer, vocab=49152, k=20)   # probes the server
    rows = teacher.sequence_rows(sequences, k=20)    # one EngineRows per packed sequence, as Teacher gives

The student's tokens go to POST {url}/completions with max_tokens 1, greedy, and come back scored, in one of
two dialects of that endpoint (the probe finds which; each parser below is a pure function of the JSON):

  vllm  prompt: the token ids (a list per document piece, all of a batch in one request), prompt_logprobs: K.
        Each choice's prompt_logprobs holds null, then at position t a dict {"id": {"logprob", "rank",
        "decoded_token"}} over token t given tokens < t: the shape vLLM's engine returns in process
        (topkd/cache/building/vllm_engine.py). Row L-1 (after the last token) comes from the generated token's
        logprobs, keyed "token_id:N" (return_tokens_as_token_ids). vLLM caps K at its --max-logprobs (20 by
        default): a larger --online-k is refused at the probe, with both remedies.
  echo  prompt: the decoded text, echo: true, logprobs: K (OpenAI's legacy shape: llama-cpp-python's server).
        The choice's logprobs hold the tokens the server read, as strings, and per position a dict
        {string: logprob}, null first. Strings map back to ids through the tokenizer; a string that several ids
        decode to (a partial UTF-8 byte, an unrendered special token) cannot, so its entry is dropped and its
        mass joins the tail. The server re-tokenises the text, so a piece it reads as other tokens (the student
        wrote a non-canonical split) cannot be aligned: its rows are left out of the loss and counted
        (`unaligned`), never guessed.

Before any generation the probe checks the server: it answers, its tokenizer gives the student's ids on a probe
text (another model's tokenizer is refused), and it scores K log-probs a position. Every later failure (a
timeout, an HTTP error, fewer positions than sent, ids past the vocabulary) is one ValueError naming the server;
the run stops there and keeps its last checkpoint. Like vLLM in process, a served teacher has no c_T: tempered
bucket KD is refused (renorm KD at any T, bucket KD at T = 1 work).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from functools import cached_property

import numpy as np

from topkd.cache.building.teacher import fingerprint
from topkd.cache.building.vllm_engine import document_pieces
from topkd.cache.format.engine_rows import EngineRows, ranked_rows

PROBE_TEXT = "The quick brown fox, 1234 times: naïve café — 日本語!\n"
DIALECTS = ("vllm", "echo")


def api_urls(url: str) -> tuple[str, str]:
    """(the OpenAI base URL ending in /v1, the server root) from what the user passed, with or without /v1."""
    base = url.rstrip("/")
    if not base.endswith("/v1"):
        base += "/v1"
    return base, base[: -len("/v1")]


def vllm_request(pieces: list[list[int]], k: int, model: str | None) -> dict:
    return {
        **({"model": model} if model else {}),
        "prompt": pieces,
        "max_tokens": 1,
        "temperature": 0.0,
        "prompt_logprobs": k,
        "logprobs": k,
        "return_tokens_as_token_ids": True,
    }


def vllm_entries(piece: list[int], choice: dict, k: int) -> list[list[tuple[int, float]]]:
    """One vLLM choice -> each row's top (id, log-prob) pairs (row t: position t + 1; the last row: the
    generated token's logprobs). Entries ranked past k (vLLM adds the actual token's) are dropped."""
    prompt = choice.get("prompt_logprobs")
    if not isinstance(prompt, list) or len(prompt) != len(piece) or prompt[0] is not None:
        got = f"length {len(prompt)}" if isinstance(prompt, list) else repr(type(prompt).__name__)
        raise ValueError(
            f"expected prompt_logprobs of {len(piece)} positions (the tokens sent) starting with null, got {got}"
        )
    rows = [
        [(int(i), float(v["logprob"])) for i, v in pos.items() if v.get("rank", 1) <= k]
        for pos in prompt[1:]
    ]
    after = ((choice.get("logprobs") or {}).get("top_logprobs") or [None])[0]
    if not after:
        raise ValueError("expected the generated token's top_logprobs (logprobs: K), got none")
    rows.append([(_token_id(key), float(lp)) for key, lp in after.items()][:k])
    return rows


def _token_id(key: str) -> int:
    if not key.startswith("token_id:"):
        raise ValueError(
            f"expected top_logprobs keyed 'token_id:N' (return_tokens_as_token_ids), got {key!r}"
        )
    return int(key[len("token_id:") :])


Entries = list[list[tuple[int, float]] | None]  # per row its (id, log-prob) pairs; None: not scored


def echo_entries(
    piece: list[int],
    choice: dict,
    k: int,
    id_of: dict[str, int],
    strings: list[str | None],
    bos: int | None = None,
) -> Entries:
    """One echoed choice -> each row's (id, log-prob) pairs, None for a row it did not score, all None where the
    server read other tokens than `piece` (it re-tokenised the text). Two layouts, told apart by their length:
    OpenAI's (the piece and the generated token, L + 1 entries, entry t over token t: row t is entry t + 1), and
    llama-cpp-python's (`llama_layout`)."""
    logprobs = choice.get("logprobs") or {}
    tokens, top = logprobs.get("tokens"), logprobs.get("top_logprobs")
    if not isinstance(tokens, list) or not isinstance(top, list) or len(top) != len(tokens):
        raise ValueError("expected logprobs with tokens and top_logprobs (echo: true, logprobs: K)")
    if len(tokens) == len(piece) + 1:
        labels, rows_at = piece, list(range(-1, len(piece)))
    else:
        labels, rows_at = llama_layout(piece, len(tokens), bos)
    if rows_at is None or not same_tokens(tokens[: len(labels)], labels, strings):
        return [None] * len(piece)
    rows: Entries = [None] * len(piece)
    for row, position in zip(rows_at, top):
        pairs = [(id_of[s], float(lp)) for s, lp in (position or {}).items() if s in id_of]
        if row >= 0:
            rows[row] = pairs or None
    return rows


def llama_layout(piece: list[int], n: int, bos: int | None) -> tuple[list[int], list[int] | None]:
    """llama-cpp-python 0.3's echo (Llama._create_completion): it drops a leading BOS from the tokens it lists but
    not from its scores, pairs listed token i with the distribution computed at position i (row i), skips every
    BOS token, and may list the generated token last; the first entry is null. So its n entries name rows
    `rows_at` and tokens `labels` (those of the piece; the generated one is not compared). None: no such
    layout gives n entries."""
    listed = piece[1:] if bos is not None and piece[:1] == [bos] else piece
    for generated in (0, 1):
        rows_at = [
            i
            for i in range(min(len(listed) + generated, len(piece)))
            if i >= len(listed) or listed[i] != bos
        ]
        if len(rows_at) == n:
            labels = [listed[i] for i in rows_at if i < len(listed)]
            return labels, rows_at
    return [], None


def same_tokens(theirs: list[str], piece: list[int], strings: list[str | None]) -> bool:
    """Whether the server read `piece`: its strings equal ours, where ours is comparable (None: a special token,
    which a server may print as '', or a byte of a character split over tokens, printed as U+FFFD here and as ''
    or a fragment there)."""
    return all(ours is None or a == ours for a, ours in zip(theirs, (strings[t] for t in piece)))


def echo_request(text: str, k: int, model: str | None) -> dict:
    return {
        **({"model": model} if model else {}),
        "prompt": text,
        "max_tokens": 1,
        "temperature": 0.0,
        "echo": True,
        "logprobs": k,
    }


def id_strings(tokenizer, vocab: int) -> tuple[list[str | None], dict[str, int]]:
    """Each id's string as a server prints it (None where it cannot be compared: special tokens, partial
    characters), and the strings that name exactly one id (the others cannot be mapped back: dropped)."""
    special = set(getattr(tokenizer, "all_special_ids", []))
    special |= {
        i for i, t in tokenizer.added_tokens_decoder.items() if getattr(t, "special", False)
    }
    strings: list[str | None] = []
    for i in range(len(tokenizer)):
        text = tokenizer.decode([i], skip_special_tokens=False)
        strings.append(None if i in special or "\ufffd" in text else text)
    strings += [None] * (vocab - len(strings))
    seen: dict[str, int] = {}
    for i, text in enumerate(strings):
        if text is not None:
            seen[text] = -1 if text in seen else i
    return strings, {text: i for text, i in seen.items() if i >= 0}


class ServedError(ValueError):
    """A served teacher's failure; unreachable: it did not answer (no other dialect is worth trying)."""

    def __init__(self, message: str, unreachable: bool = False):
        super().__init__(message)
        self.unreachable = unreachable


class ServedTeacher:
    """A TeacherEngine (topkd/cache/building/teacher.py) whose rows a completions server computes."""

    def __init__(
        self, url: str, tokenizer, vocab: int, k: int, timeout: float = 120.0, api: str = "auto"
    ):
        if k < 1:
            raise ValueError(
                f"--teacher-url {url}: expected --online-k >= 1 (a server returns its top-K log-probs), "
                f"got {k}; pass --online-k 20 (vLLM's default cap)"
            )
        self.url, self.root = api_urls(url)
        self.tokenizer, self.vocab, self.k, self.timeout = tokenizer, vocab, k, timeout
        self.source = self.url
        self.unaligned = 0  # pieces an echo server read as other tokens: left out of the loss
        self.model = self._model_name()
        self.api = self._probe(api)

    @cached_property
    def _id_strings(self) -> tuple[list[str | None], dict[str, int]]:
        """id_strings of the tokenizer: one decode per id, so made only once the echo dialect needs them."""
        return id_strings(self.tokenizer, self.vocab)

    def _post(self, path: str, body: dict) -> dict:
        return self._call(path, json.dumps(body).encode())

    def _call(self, path: str, data: bytes | None) -> dict:
        headers = {"Content-Type": "application/json"}
        request = urllib.request.Request(self.root + path, data=data, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as e:
            raise self.error(f"HTTP {e.code} on {path}: {_server_message(e)}") from None
        except TimeoutError:
            raise self.error(f"no answer on {path} within {self.timeout:g} s", True) from None
        except (urllib.error.URLError, ConnectionError) as e:
            reason = getattr(e, "reason", e)
            raise self.error(
                f"could not reach {path} ({reason}); is the server up?", True
            ) from None
        except json.JSONDecodeError as e:
            raise self.error(f"expected JSON from {path}, got {e}") from None

    def error(self, what: str, unreachable: bool = False) -> ServedError:
        return ServedError(f"teacher server {self.url}: {what}", unreachable)

    def _model_name(self) -> str | None:
        models = self._call("/v1/models", None).get("data") or []
        return models[0].get("id") if models else None

    def _probe(self, api: str) -> str:
        """The dialect, after checking the server's tokenizer against ours and that it scores K a position."""
        # the special tokens too: a chat model's and its base's tokenizers differ in those alone
        text = PROBE_TEXT + "".join(getattr(self.tokenizer, "all_special_tokens", []))
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        theirs = self._server_tokens(text)
        if theirs is not None and theirs != ids:
            raise self.error(
                f"its tokenizer gives {theirs[:8]}... for a probe text, the student's gives {ids[:8]}...: "
                "another model's tokenizer; serve a teacher whose tokenizer the student shares"
            )
        problems = []
        for dialect in DIALECTS if api == "auto" else (api,):
            self.api = dialect
            try:
                self._score([ids])
                return dialect
            except ServedError as e:
                if e.unreachable:
                    raise
                said = str(e).removeprefix(str(self.error("")))
                if (
                    "max" in said.lower() and "logprob" in said.lower()
                ):  # vLLM: "... max allowed: 20"
                    raise self.error(
                        f"it refuses {self.k} log-probs a position ({said}); lower --online-k, or raise "
                        "the server's cap (vllm serve --max-logprobs K)"
                    ) from None
                problems.append(f"{dialect}: {said}")
        raise self.error(
            f"expected prompt log-probs from POST /v1/completions (vLLM's prompt_logprobs or echo + "
            f"logprobs), got {'; '.join(problems)}"
        )

    def _server_tokens(self, text: str) -> list[int] | None:
        """The server's ids for text (vLLM's /tokenize, llama-cpp-python's /extras/tokenize); None: neither."""
        for path, body in (
            ("/tokenize", {"prompt": text, "add_special_tokens": False}),
            ("/extras/tokenize", {"input": text}),
        ):
            try:
                tokens = self._post(path, {**body, **({"model": self.model} if self.model else {})})
            except ServedError as e:
                if e.unreachable:
                    raise
                continue
            tokens = list(tokens.get("tokens") or [])
            bos = self.tokenizer.bos_token_id
            return tokens[1:] if tokens[:1] == [bos] and bos is not None else tokens
        return None

    def sequence_rows(
        self,
        sequences: list,
        k: int | None = None,
        temperatures=(),
        batch_size=0,
        on_batch=None,
        sampler=None,
    ) -> list[EngineRows]:
        """Rows for packed sequences: each document piece scored as its own prompt (as vLLM in process)."""
        if temperatures or sampler is not None:
            raise self.error(
                "expected top-K rows at T = 1 (a server gives no c_T and draws no samples)"
            )
        pieces = [document_pieces(np.asarray(s.tokens), s.doc_starts) for s in sequences]
        flat = [[int(t) for t in p] for ps in pieces for p in ps]
        scored = iter(self._score(flat))
        rows = [EngineRows.concat([next(scored) for _ in ps]) for ps in pieces]
        if on_batch is not None:
            on_batch(sum(len(s.tokens) for s in sequences))
        return rows

    def _score(self, pieces: list[list[int]]) -> list[EngineRows]:
        if self.api == "vllm":
            choices = self._post("/v1/completions", vllm_request(pieces, self.k, self.model))
            ordered = sorted(self._choices(choices, len(pieces)), key=lambda c: c.get("index", 0))
            entries = [self._checked(vllm_entries, p, c, self.k) for p, c in zip(pieces, ordered)]
        else:
            entries = []
            for p in pieces:
                text = self.tokenizer.decode(p, skip_special_tokens=False)
                answer = self._post("/v1/completions", echo_request(text, self.k, self.model))
                strings, id_of = self._id_strings
                bos = self.tokenizer.bos_token_id
                got = self._checked(
                    echo_entries, p, self._choices(answer, 1)[0], self.k, id_of, strings, bos
                )
                self.unaligned += all(row is None for row in got)
                entries.append(got)
        return [self._rows(p, e) for p, e in zip(pieces, entries)]

    def _choices(self, response: dict, n: int) -> list[dict]:
        choices = response.get("choices")
        if not isinstance(choices, list) or len(choices) != n:
            got = len(choices) if isinstance(choices, list) else "none"
            raise self.error(f"expected {n} choices (one per prompt sent), got {got}")
        return choices

    def _checked(self, parse, piece, choice, *args):
        try:
            entries = parse(piece, choice, *args)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise self.error(f"{self.api} response: {e}") from None
        past = [i for row in entries if row for i, _ in row if not 0 <= i < self.vocab]
        if past:
            raise self.error(
                f"expected ids below the student's vocabulary of {self.vocab}, got {past[0]}: another model's ids"
            )
        return entries

    def _rows(self, piece: list[int], entries: Entries) -> EngineRows:
        """Rows in rank order; one the server did not score is a valid placeholder, marked for the loss to skip."""
        scored = np.array([row is not None for row in entries])
        placeholder = [(piece[0], 0.0)]
        return ranked_rows([row or placeholder for row in entries], self.k, scored)

    def fingerprint(self, k: int, temperatures: tuple[float, ...]) -> dict:
        return fingerprint(
            source=self.url,
            weights_sha256="",
            config_sha256="",
            tokenizer=self.tokenizer,
            dtype="served",
            vocab=self.vocab,
            k=k,
            temperatures=temperatures,
            engine=f"served {self.api} {self.model}",
        )


def _server_message(e: urllib.error.HTTPError) -> str:
    """The error text of an OpenAI-style error body ({"message"} or {"error": {"message"}}), else the raw body."""
    body = e.read().decode(errors="replace")
    try:
        parsed = json.loads(body)
    except json.JSONDecodeError:
        return body.strip()[:300] or e.reason
    inner = parsed.get("error", parsed) if isinstance(parsed, dict) else parsed
    if isinstance(inner, dict):
        return str(inner.get("message", inner))[:300]
    return str(inner)[:300]
