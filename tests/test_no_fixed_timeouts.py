"""No fixed number of seconds bounds a wait in a test: a hang guard is `hang_deadline(base_s)`
(tests/conftest.py), which scales with this host's measured speed. A literal `timeout=60` on a
subprocess, `.wait(5)` or `.join(timeout=5)` trips on a slow or loaded host for a reason the test
is not about. Every file is clear of them; a new one anywhere fails here. A helper outside a
test takes the fixture's function from its caller (`hang_deadline=hang_deadline`)."""
import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


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
    """Line numbers of calls bounded by a literal number of seconds: a `timeout=` keyword, or the
    first positional argument of `.wait(...)` / `.join(...)`."""
    lines = []
    for node in ast.walk(ast.parse(source, name)):
        if not isinstance(node, ast.Call):
            continue
        kws = {k.arg for k in node.keywords}
        if "hang_deadline" in kws:  # a helper that scales the base seconds itself
            continue
        if any(k.arg == "timeout" and _numeric(k.value) for k in node.keywords):
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
               "s = 'last_call_timeout=2'\n")
    assert fixed_timeouts(planted) == [2, 3, 4]
