"""No fixed number of seconds bounds a wait in a test: a hang guard is `hang_deadline(base_s)`
(tests/conftest.py), which scales with this host's measured speed. A literal `timeout=60` on a
subprocess, `.wait(5)` or `.join(timeout=5)` trips on a slow or loaded host for a reason the test
is not about. So is a literal `timeout_s=` given to `run_ranks` or `verify` (their ranks' process
group timeout), and a `run_ranks(...)` without one: its default is a fixed 120 s. Every file is
clear of them; a new one anywhere fails here. A helper outside a test takes the fixture's function
from its caller (`hang_deadline=hang_deadline`)."""
import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
# Helpers whose `timeout_s` bounds the test's own wait for its ranks (elsewhere `timeout_s=` is often
# the value under test: a heartbeat's, a group's, a line's).
BOUNDED_S = ("run_ranks", "verify")


def _numeric(node: ast.AST) -> bool:
    """A number, or arithmetic on numbers only (`2 * 60`)."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (int, float)) and not isinstance(node.value, bool)
    if isinstance(node, ast.BinOp):
        return _numeric(node.left) and _numeric(node.right)
    if isinstance(node, ast.UnaryOp):
        return _numeric(node.operand)
    return False


def fixed_timeouts(source: str, name: str = "<test>") -> list[int]:
    """Line numbers of calls bounded by a literal number of seconds: a `timeout=` or `timeout_s=`
    keyword, the first positional argument of `.wait(...)` / `.join(...)`, or `run_ranks(...)` left
    at its fixed default."""
    lines = []
    for node in ast.walk(ast.parse(source, name)):
        if not isinstance(node, ast.Call):
            continue
        kws = {k.arg for k in node.keywords}
        if "hang_deadline" in kws:  # a helper that scales the base seconds itself
            continue
        name = getattr(node.func, "id", None)
        if any(k.arg == "timeout" and _numeric(k.value) for k in node.keywords):
            lines.append(node.lineno)
        elif name in BOUNDED_S and any(k.arg == "timeout_s" and _numeric(k.value) for k in node.keywords):
            lines.append(node.lineno)
        elif name == "run_ranks" and "timeout_s" not in kws:
            lines.append(node.lineno)
        elif (isinstance(node.func, ast.Attribute) and node.func.attr in ("wait", "join")
              and node.args and _numeric(node.args[0])):
            lines.append(node.lineno)
    return lines


def test_no_new_fixed_timeouts():
    found = {}
    for path in sorted(TESTS.rglob("*.py")):
        rel = path.relative_to(TESTS).as_posix()
        hits = fixed_timeouts(path.read_text(), rel)
        if hits:
            found[rel] = hits
    assert not found, f"fixed seconds as a bound (use hang_deadline): {found}"


def test_the_scan_finds_each_planted_kind():
    planted = ("import subprocess\n"
               "subprocess.run(['x'], timeout=60)\n"
               "p.wait(timeout=2 * 5)\n"
               "t.join(5)\n"
               "q.wait()\n"
               "subprocess.run(['x'], timeout=hang_deadline(60))\n"
               "_run(x, timeout=590, hang_deadline=hang_deadline)\n"
               "s = 'last_call_timeout=2'\n"
               "run_ranks(2, f, x, timeout_s=240)\n"
               "run_ranks(2, f, x)\n"
               "run_ranks(2, f, x, timeout_s=hang_deadline(240))\n")
    assert fixed_timeouts(planted) == [2, 3, 4, 9, 10]
