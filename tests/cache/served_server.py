"""A vLLM-shaped completions server over an in-memory teacher, for the tests of topkd/cache/building/served.py.

    python -m tests.cache.served_server TEACHER_DIR PORT_FILE [--cap 20] [--delay S]   # writes its port

It answers what the served client asks vLLM's OpenAI server for, in vLLM's documented shapes: GET /v1/models,
POST /tokenize, POST /v1/completions with token-id prompts, prompt_logprobs and return_tokens_as_token_ids
(prompt_logprobs: null first, then {"id": {"logprob", "rank", "decoded_token"}} with the actual token added at
its rank when outside the top K, as vLLM adds it). The numbers are the teacher's own rows (Teacher.sequence_rows),
so a run through it must train as the in-process teacher does. --cap refuses more log-probs as vLLM's
--max-logprobs does (HTTP 400, vLLM's message); --delay sleeps before each completion (timeouts).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np

from topkd.cache.building.teacher import load_teacher
from topkd.data.documents import Sequence


def vllm_choice(teacher, prompt: list[int], k: int, index: int) -> dict:
    """One prompt's choice as vLLM's server writes it (row t of the teacher -> position t + 1)."""
    seq = Sequence(np.asarray(prompt, np.int64), np.zeros(1, np.int64), 0, 0)
    rows = teacher.sequence_rows([seq], k, (), 1)[0]
    decode = teacher.tokenizer.decode
    positions: list = [None]
    for t in range(1, len(prompt)):
        ids, lps = rows.ids[t - 1], rows.logprobs[t - 1]
        entry = {
            str(int(i)): {"logprob": float(lp), "rank": r + 1, "decoded_token": decode([int(i)])}
            for r, (i, lp) in enumerate(zip(ids, lps))
        }
        if str(prompt[t]) not in entry:  # vLLM adds the actual token at its rank
            entry[str(prompt[t])] = {
                "logprob": float(lps[-1]) - 1.0,
                "rank": k + 7,
                "decoded_token": "",
            }
        positions.append(entry)
    last = {f"token_id:{int(i)}": float(lp) for i, lp in zip(rows.ids[-1], rows.logprobs[-1])}
    first = next(iter(last))
    return {
        "index": index,
        "text": decode([int(first.split(":")[1])]),
        "logprobs": {
            "tokens": [first],
            "token_logprobs": [last[first]],
            "top_logprobs": [last],
            "text_offset": [0],
        },
        "finish_reason": "length",
        "prompt_logprobs": positions,
    }


def make_handler(teacher, cap: int, delay: float, mangle=None):
    lock = threading.Lock()  # one forward at a time, as one engine

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def _send(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/v1/models":
                return self._send(
                    200, {"object": "list", "data": [{"id": "tiny-teacher", "object": "model"}]}
                )
            self._send(404, {"detail": "Not Found"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path == "/tokenize":
                ids = teacher.tokenizer.encode(body["prompt"], add_special_tokens=False)
                return self._send(200, {"tokens": ids, "count": len(ids), "max_model_len": 4096})
            if self.path != "/v1/completions":
                return self._send(404, {"detail": "Not Found"})
            k = int(body.get("prompt_logprobs") or 0)
            if k > cap:
                message = (
                    f"Requested prompt logprobs of {k}, which is greater than max allowed: {cap}"
                )
                return self._send(
                    400, {"error": {"message": message, "type": "BadRequestError", "code": 400}}
                )
            prompts = body["prompt"]
            if not isinstance(prompts, list) or not all(isinstance(p, list) for p in prompts):
                return self._send(
                    400, {"error": {"message": "this server takes token-id prompts only"}}
                )
            time.sleep(delay)
            with lock:
                choices = [vllm_choice(teacher, p, k, i) for i, p in enumerate(prompts)]
            if mangle is not None:  # a test's broken server
                choices = mangle(choices)
            self._send(
                200,
                {
                    "id": "cmpl-0",
                    "object": "text_completion",
                    "model": "tiny-teacher",
                    "choices": choices,
                },
            )

    return Handler


def start(
    teacher_dir: str, cap: int = 20, delay: float = 0.0, mangle=None
) -> tuple[ThreadingHTTPServer, str]:
    """The server in a thread of this process; (server, base URL). stop(server) closes it."""
    handler = make_handler(load_teacher(teacher_dir), cap, delay, mangle)
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/v1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    cmd: list[str], port: int, log_path, seconds: float, env=None
) -> tuple[subprocess.Popen, str]:
    """A real server process (llama-cpp-python's, vLLM's) listening on port: (the process, its base URL) once
    GET /v1/models answers; it failing or taking over `seconds` fails the test with its log's tail."""
    proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=env)
    url, deadline = f"http://127.0.0.1:{port}/v1", time.time() + seconds
    while True:
        try:
            urllib.request.urlopen(url + "/models", timeout=5).read()
            return proc, url
        except OSError:
            assert proc.poll() is None and time.time() < deadline, open(log_path).read()[-3000:]
            time.sleep(0.5)


def chat_sequence(tokenizer, messages) -> Sequence:
    """A conversation rendered with the tokenizer's chat template, as one packed sequence."""
    ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    return Sequence(np.asarray(ids, np.int64), np.zeros(1, np.int64), 0, 0)


CHATS = [  # what the real-server tests score
    [
        {"role": "user", "content": "What is the capital of France? Answer in one sentence."},
        {"role": "assistant", "content": "The capital of France is Paris, a city on the Seine."},
    ],
    [
        {"role": "user", "content": "Write a haiku about rain."},
        {
            "role": "assistant",
            "content": "Soft rain on the roof / whispers to the sleeping town / lights glow warm",
        },
    ],
]


def stop(server: ThreadingHTTPServer) -> None:
    server.shutdown()
    server.server_close()  # else the port still takes connections nobody answers


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("teacher")
    parser.add_argument("port_file")
    parser.add_argument("--cap", type=int, default=20)
    parser.add_argument("--delay", type=float, default=0.0)
    args = parser.parse_args()
    server = ThreadingHTTPServer(
        ("127.0.0.1", 0), make_handler(load_teacher(args.teacher), args.cap, args.delay)
    )
    with open(args.port_file + ".tmp", "w") as f:
        f.write(str(server.server_address[1]))
    os.replace(args.port_file + ".tmp", args.port_file)
    server.serve_forever()


if __name__ == "__main__":
    main()
