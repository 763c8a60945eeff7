"""math-verify worker process (run as a script by es_ray.grading.mathverify; never imported).

Protocol on stdin/stdout, one JSON object per line: first it writes {"ready": true}; then for each request
{"id", "gold", "pred"} it writes {"id", "ok", "answer"} or {"id", "error"}. math-verify's own SIGALRM timeouts
are disabled: the parent enforces the time limit by killing this process, which works from any thread.
"""

import json
import os
import resource
import sys

# math_verify is imported after stdout is moved aside: what it prints on import goes to stderr, not into the protocol.


def main() -> None:
    memory_mb = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    if memory_mb > 0:  # sympy on a hostile expression can also blow up memory
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    # Protocol lines go to a private copy of stdout; anything a library prints goes to stderr (discarded).
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    import logging

    logging.disable(logging.CRITICAL)  # math-verify warns that its timeout is disabled, on every call
    from math_verify import parse, verify

    out.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        req = json.loads(line)
        try:
            gold = parse(req["gold"], parsing_timeout=None)
            pred = parse(req["pred"], parsing_timeout=None)
            ok = bool(gold) and bool(pred) and bool(verify(gold, pred, timeout_seconds=None))
            answer = None
            if pred:  # the vote key: "x = 14/3" and "14/3" are the same answer
                key = pred[0]
                if getattr(key, "is_Relational", False) and getattr(key.lhs, "is_Symbol", False):
                    key = key.rhs
                answer = str(key)[:200]
            reply = {"id": req["id"], "ok": ok, "answer": answer}
        except (Exception, RecursionError, MemoryError) as exc:
            reply = {"id": req["id"], "error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        out.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    main()
