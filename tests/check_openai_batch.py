#!/usr/bin/env python3
"""check_openai_batch.py REQUESTS OUTPUT — checks a batch output file
against OpenAI's Batch output format only (nothing flotilla-specific): one
line per request, {"id", "custom_id", "response": {"status_code",
"request_id", "body"}, "error"}; 200 bodies are "text_completion" or
"chat.completion" objects (validated with the official `openai` package's
types when it is installed, and always by the strict checks below), error
bodies are OpenAI error objects. For each request it checks the choice
count (n), usage sums, and that logprobs are valid: <= 0, top_logprobs
sorted, the chosen token's logprob equal to its entry in the top list, the
greedy choice the most likely, one entry per completion token.
Exits 1 with a message on the first violation; prints a summary."""
import json
import math
import sys

try:  # the official types, when installed (scripts/setup.sh installs them)
    from openai.types import Completion
    from openai.types.chat import ChatCompletion
except ImportError:
    Completion = ChatCompletion = None


def fail(msg):
    print("FAIL - " + msg)
    sys.exit(1)


def need(cond, msg):
    if not cond:
        fail(msg)


def is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def lp_ok(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v <= 0 and not math.isnan(v)


def check_completion_logprobs(cid, ch, want_top, greedy):
    lp = ch["logprobs"]
    need(isinstance(lp, dict), f"{cid}: logprobs must be an object")
    toks, lps, tops, offs = lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], lp["text_offset"]
    need(len(toks) == len(lps) == len(tops) == len(offs), f"{cid}: logprobs arrays differ in length")
    for i, (t, v, d, o) in enumerate(zip(toks, lps, tops, offs)):
        need(isinstance(t, str) and lp_ok(v), f"{cid}: token {i}: bad token/logprob {t!r} {v!r}")
        need(is_int(o) and (i == 0 or o >= offs[i - 1]), f"{cid}: text_offset {i} not ascending")
        need(isinstance(d, dict) and 1 <= len(d) <= want_top + 1, f"{cid}: top_logprobs {i} has {len(d)} entries")
        need(all(lp_ok(x) for x in d.values()), f"{cid}: top_logprobs {i} has a positive value")
        if t in d:
            need(abs(d[t] - v) <= 1e-6, f"{cid}: token {i} {t!r}: logprob {v} but top entry {d[t]}")
        if greedy and want_top > 0:
            need(v >= max(d.values()) - 1e-6, f"{cid}: greedy token {i} is not the most likely")
    return len(toks)


def check_chat_logprobs(cid, ch, want_top, greedy):
    lp = ch["logprobs"]
    need(isinstance(lp, dict) and isinstance(lp.get("content"), list), f"{cid}: logprobs.content missing")
    for i, e in enumerate(lp["content"]):
        need(isinstance(e["token"], str) and lp_ok(e["logprob"]), f"{cid}: content {i} bad token/logprob")
        need(isinstance(e["bytes"], list) and all(is_int(b) and 0 <= b < 256 for b in e["bytes"]),
             f"{cid}: content {i} bytes")
        top = e["top_logprobs"]
        need(len(top) == want_top, f"{cid}: content {i}: {len(top)} top_logprobs, asked {want_top}")
        vals = [a["logprob"] for a in top]
        need(all(lp_ok(x) for x in vals), f"{cid}: content {i}: a top logprob > 0")
        need(vals == sorted(vals, reverse=True), f"{cid}: content {i}: top_logprobs not sorted")
        for a in top:
            if a["token"] == e["token"] and a["bytes"] == e["bytes"]:
                need(abs(a["logprob"] - e["logprob"]) <= 1e-6, f"{cid}: content {i}: chosen token's "
                     f"logprob {e['logprob']} but its top entry {a['logprob']}")
        if greedy and top:
            need(e["logprob"] >= vals[0] - 1e-6, f"{cid}: content {i}: greedy token not the most likely")
    return len(lp["content"])


def main():
    reqs = {}
    for line in open(sys.argv[1]):
        if line.strip():
            r = json.loads(line)
            reqs[r["custom_id"]] = r
    seen = {}
    n_ok = n_err = n_choices = n_lp_tokens = 0
    for k, line in enumerate(open(sys.argv[2]), 1):
        rec = json.loads(line)
        need(set(rec) == {"id", "custom_id", "response", "error"}, f"line {k}: keys {sorted(rec)}")
        need(isinstance(rec["id"], str) and rec["id"].startswith("batch_req_"), f"line {k}: id")
        cid = rec["custom_id"]
        need(cid in reqs, f"line {k}: custom_id {cid!r} is not a request's")
        need(cid not in seen, f"custom_id {cid!r} twice (lines {seen.get(cid)} and {k})")
        seen[cid] = k
        need(rec["error"] is None, f"{cid}: top-level error {rec['error']}")
        resp = rec["response"]
        need(is_int(resp["status_code"]) and isinstance(resp["request_id"], str), f"{cid}: response")
        body = resp["body"]
        req = reqs[cid]
        rb = req["body"]
        if resp["status_code"] != 200:
            err = body["error"]
            need(isinstance(err["message"], str) and isinstance(err["type"], str), f"{cid}: error object")
            need(err["param"] is None or isinstance(err["param"], str), f"{cid}: error.param")
            need(err.get("code") is None or isinstance(err["code"], str), f"{cid}: error.code")
            n_err += 1
            continue
        chat = "messages" in rb
        need(req.get("url", "/v1/chat/completions" if chat else "/v1/completions") ==
             ("/v1/chat/completions" if chat else "/v1/completions"), f"{cid}: url/body mismatch")
        if chat and ChatCompletion:
            ChatCompletion.model_validate(body)
        if not chat and Completion:
            Completion.model_validate(body)
        need(body["object"] == ("chat.completion" if chat else "text_completion"), f"{cid}: object")
        need(isinstance(body["id"], str) and is_int(body["created"]) and isinstance(body["model"], str),
             f"{cid}: id/created/model")
        n = rb.get("n", 1)
        choices = body["choices"]
        need(len(choices) == n, f"{cid}: {len(choices)} choices, n = {n}")
        need([c["index"] for c in choices] == list(range(n)), f"{cid}: choice indexes")
        greedy = rb.get("temperature", 0) == 0
        want_lp = rb.get("logprobs") not in (None, False)
        want_top = rb.get("top_logprobs", 0) if chat else (rb.get("logprobs") or 0)
        lp_tokens = 0
        for c in choices:
            need(c["finish_reason"] in ("stop", "length"), f"{cid}: finish_reason {c['finish_reason']}")
            if chat:
                need(c["message"]["role"] == "assistant" and isinstance(c["message"]["content"], str),
                     f"{cid}: message")
            else:
                need(isinstance(c["text"], str), f"{cid}: text")
            if not want_lp:
                need(c["logprobs"] is None, f"{cid}: logprobs without asking")
                continue
            cnt = (check_chat_logprobs if chat else check_completion_logprobs)(cid, c, want_top, greedy)
            mt = rb.get("max_completion_tokens", rb.get("max_tokens"))
            if c["finish_reason"] == "length" and mt:
                need(cnt == mt, f"{cid}: length finish after {cnt} of {mt} tokens")
            lp_tokens += cnt
        u = body["usage"]
        need(all(is_int(u[x]) for x in ("prompt_tokens", "completion_tokens", "total_tokens")), f"{cid}: usage")
        need(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"], f"{cid}: usage sum")
        if want_lp:  # one logprobs entry per completion token, over all choices
            need(u["completion_tokens"] == lp_tokens, f"{cid}: usage says {u['completion_tokens']} "
                 f"completion tokens, logprobs hold {lp_tokens}")
        if greedy and n > 1:
            texts = {c["message"]["content"] if chat else c["text"] for c in choices}
            need(len(texts) == 1, f"{cid}: greedy choices differ")
        n_ok += 1
        n_choices += n
        n_lp_tokens += lp_tokens
    need(set(seen) == set(reqs), f"requests without a result: {sorted(set(reqs) - set(seen))}")
    types = "official openai types + strict checks" if Completion else "strict checks (openai not installed)"
    print(f"ok   - {n_ok} results ({n_choices} choices, {n_lp_tokens} tokens with logprobs), "
          f"{n_err} error records: OpenAI Batch format ({types})")


if __name__ == "__main__":
    main()
