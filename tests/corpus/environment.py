# The process around the nodes: environment variables, the working directory, sys.argv and
# sys.path, changed by the script between calls on one engine. A node reading them computes what
# it would compute in the calling process. Run as `python - EXECUTOR < environment.py`.
import os
import sys

import corpus
from corpus import pattern, write
from hardy import Pipeline, node

engine = corpus.engine()
XS = list(range(8))  # chunks on both of an engine's workers


@node(output_name="y")
def mode(x):
    return f"{os.environ.get('MODE', 'unset')}-{x}"


def ys(nodes, xs=XS, output="y"):
    out = corpus.pipeline(nodes, engine).map(inputs={"x": xs}, map_over="x")
    return [o[output] for o in out]


@node(output_name="y")
def started(x):
    return f"{os.environ.get('CORPUS_STARTED', 'unset')}-{x}"


@pattern
def environ_started_with_changed_then_set_back():
    # first in the file: a local Ray starts here, its workers keeping "changed"; set back, it must be sent
    os.environ["CORPUS_STARTED"] = "changed"
    first = ys([started])
    os.environ["CORPUS_STARTED"] = "start"
    return [first, ys([started])]


@pattern
def environ_started_with_removed_then_set_back():
    del os.environ["CORPUS_STARTED"]
    first = ys([started])
    os.environ["CORPUS_STARTED"] = "start"
    return [first, ys([started])]


@pattern
def environ_set_before_the_first_call():
    os.environ["MODE"] = "first"
    return ys([mode])


@pattern
def environ_changed_between_maps():
    os.environ["MODE"] = "first"
    first = ys([mode])
    os.environ["MODE"] = "second"
    return [first, ys([mode])]


@pattern
def environ_deleted_between_maps():
    os.environ["MODE"] = "there"
    first = ys([mode])
    del os.environ["MODE"]
    return [first, ys([mode])]


@pattern
def environ_changed_between_runs():
    p = Pipeline(nodes=[mode], engine=engine)
    os.environ["MODE"] = "a"
    first = p.run(inputs={"x": 0})
    os.environ["MODE"] = "b"
    return [first, p.run(inputs={"x": 0})]


@pattern
def environ_set_with_putenv_style_update():
    os.environ.update({"MODE": "bulk", "OTHER": "o"})
    os.environ.setdefault("MODE", "ignored")
    return ys([mode])


@pattern
def environ_variable_the_worker_started_with_removed():
    # PATH is in every worker's own environment: removed here, a node must not see it.
    @node(output_name="y")
    def has_path(x):
        return ("PATH" in os.environ, x)

    first = ys([has_path])
    path = os.environ.pop("PATH")
    second = ys([has_path])
    os.environ["PATH"] = path
    return [first, second]


@pattern
def environ_read_by_a_helper_module():
    write("env_helpers.py", """
        import os

        def device():
            return os.getenv("DEVICE", "cpu")
    """)
    write("env_steps.py", """
        import env_helpers
        from hardy import node

        @node(output_name="y")
        def placed(x):
            return f"{env_helpers.device()}:{x}"
    """)
    import env_steps
    os.environ["DEVICE"] = "cuda:1"
    return ys([env_steps.placed])


@pattern
def environ_imported_by_name_and_set_in_the_node():
    # `from os import environ`: the node's global is the process's own environment, which a
    # variable it sets there reaches (`os.getenv`, a subprocess), as in the calling process
    from os import environ

    @node(output_name="y")
    def exported(x):
        environ["STEP"] = str(x)
        return f"{environ.get('MODE', 'unset')}/{os.getenv('STEP')}/{x}"

    os.environ["STEP"] = "caller"
    os.environ["MODE"] = "first"
    first = ys([exported])
    os.environ["MODE"] = "second"
    return [first, ys([exported])]


@pattern
def environ_read_at_import_of_the_nodes_module():
    os.environ["STAGE"] = "import-time"
    write("envimp_steps.py", """
        import os
        from hardy import node
        STAGE = os.environ.get("STAGE", "none")

        @node(output_name="y")
        def staged(x):
            return f"{STAGE}/{os.environ.get('STAGE')}/{x}"
    """)
    import envimp_steps
    os.environ["STAGE"] = "call-time"
    return ys([envimp_steps.staged])


@pattern
def working_directory_changed_between_maps():
    for name, text in (("a", "alpha"), ("b", "beta")):
        os.makedirs(name, exist_ok=True)
        with open(os.path.join(name, "data.txt"), "w") as f:
            f.write(text)

    @node(output_name="y")
    def read(x):
        with open("data.txt") as f:
            return f"{f.read()}{x}"

    os.chdir("a")
    first = ys([read])
    os.chdir("../b")
    return [first, ys([read])]


@pattern
def working_directory_changed_and_a_relative_file_written():
    os.makedirs("out", exist_ok=True)

    @node(output_name="y")
    def saved(x):
        with open(f"item{x}.txt", "w") as f:
            f.write(str(x))
        return os.path.basename(os.getcwd())

    os.chdir("out")
    names = ys([saved])
    os.chdir("..")
    return [names, sorted(os.listdir("out"))]


@pattern
def working_directory_changed_between_runs():
    os.makedirs("r1", exist_ok=True)
    os.makedirs("r2", exist_ok=True)

    @node(output_name="y")
    def where(x):
        return os.path.basename(os.getcwd())

    p = Pipeline(nodes=[where], engine=engine)
    os.chdir("r1")
    first = p.run(inputs={"x": 0})
    os.chdir("../r2")
    return [first, p.run(inputs={"x": 0})]


@pattern
def relative_path_resolved_by_a_module_at_import():
    os.makedirs("proj/data", exist_ok=True)
    with open("proj/data/labels.txt", "w") as f:
        f.write("cat dog")
    write("relimp_steps.py", """
        import os
        from hardy import node
        DATA = os.path.abspath("proj/data")

        @node(output_name="y")
        def labels(x):
            with open(os.path.join(DATA, "labels.txt")) as f:
                return f.read().split()[x % 2]
    """)
    import relimp_steps
    os.chdir("proj")  # the module resolved its path already, in the folder above
    return ys([relimp_steps.labels])


@pattern
def argv_appended():
    @node(output_name="y")
    def flags(x):
        return [a for a in sys.argv[1:] if a.startswith("--")] + [x]

    sys.argv.append("--fast")
    first = ys([flags])
    sys.argv.append("--verbose")
    return [first, ys([flags])]


@pattern
def argv_replaced_by_an_argument_parser_setup():
    import argparse

    @node(output_name="y")
    def parsed(x):
        parser = argparse.ArgumentParser()
        parser.add_argument("executor")
        parser.add_argument("--epochs", type=int, default=1)
        return parser.parse_args(sys.argv[1:]).epochs * x

    sys.argv[1:] = [sys.argv[1], "--epochs", "7"]
    return ys([parsed])


@pattern
def sys_path_extended_to_import_a_module_only_there():
    write("plugins/only_here.py", """
        def plugin(x):
            return f"plugin:{x}"
    """)

    @node(output_name="y")
    def plugged(x):
        import only_here
        return only_here.plugin(x)

    sys.path.append(os.path.abspath("plugins"))
    return ys([plugged])


@pattern
def sys_path_extended_for_the_nodes_own_module():
    write("extra/ext_steps.py", """
        from hardy import node

        @node(output_name="y")
        def extended(x):
            return x * 111
    """)
    sys.path.insert(0, os.path.abspath("extra"))
    import ext_steps
    return ys([ext_steps.extended])


@pattern
def sys_path_order_changed_to_shadow_a_module():
    write("v1/shadowed.py", "VERSION = 'v1'\n")
    write("v2/shadowed.py", "VERSION = 'v2'\n")

    @node(output_name="y")
    def version(x):
        import shadowed
        return shadowed.VERSION

    sys.path.insert(0, os.path.abspath("v2"))
    sys.path.insert(0, os.path.abspath("v1"))
    return ys([version])


@pattern
def timezone_set_by_the_script():
    import time

    @node(output_name="y")
    def local_hour(x):
        return time.localtime(86400 * x).tm_hour

    os.environ["TZ"] = "Asia/Tokyo"
    time.tzset()
    return ys([local_hour])


@pattern
def umask_set_by_the_script():
    @node(output_name="y")
    def mode_bits(x):
        path = f"umask{x}.txt"
        with open(path, "w") as f:
            f.write("x")
        return oct(os.stat(path).st_mode & 0o777)

    previous = os.umask(0o077)
    try:
        return ys([mode_bits])
    finally:
        os.umask(previous)


@pattern
def order_of_a_set_of_strings():
    # str hashes are salted per process (unless PYTHONHASHSEED is set): a set's order is the
    # process's, so each script run has its own; what compares is whether the map's answer is the
    # one this process computes
    @node(output_name="y")
    def unique_words(x):
        words = [f"token{k}" for k in range(30)] * x
        return list(set(words))[:8]

    return ys([unique_words], xs=[1, 2]) == [unique_words(x) for x in [1, 2]]


@pattern
def warnings_made_errors_by_the_script():
    import warnings

    @node(output_name="y")
    def warned(x):
        try:
            warnings.warn(f"item {x} is odd", UserWarning, stacklevel=1)
        except UserWarning as w:
            return f"error: {w}"
        return "went on"

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        strict = ys([warned], xs=[1, 2])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [strict, ys([warned], xs=[3])]


@pattern
def decimal_context_set_by_the_script():
    import decimal

    @node(output_name="y")
    def third(x):
        return str(decimal.Decimal(x) / 3)

    decimal.getcontext().prec = 5
    decimal.getcontext().rounding = decimal.ROUND_DOWN
    try:
        return ys([third], xs=[1, 2])
    finally:
        decimal.setcontext(decimal.Context())


@pattern
def recursion_limit_raised_by_the_script():
    @node(output_name="y")
    def depth(x):
        def down(n):
            return 0 if n == 0 else 1 + down(n - 1)
        return down(1500 * x)

    previous = sys.getrecursionlimit()
    sys.setrecursionlimit(5000)
    try:
        return ys([depth], xs=[1, 2])
    finally:
        sys.setrecursionlimit(previous)


@pattern
def numpy_division_by_zero_made_an_error():
    import numpy as np

    @node(output_name="y")
    def ratio(x):
        try:
            return float(np.float64(x) / np.float64(x - 1))
        except FloatingPointError as exc:
            return f"raised: {exc}"

    previous = np.seterr(divide="raise")
    try:
        return ys([ratio], xs=[1, 2])
    finally:
        np.seterr(**previous)


@pattern
def numpy_division_by_zero_calls_the_scripts_callback():
    # np.seterr(divide="call") with a function of the script (and "log" with an object's write)
    import numpy as np

    def flagged(kind, flag):
        raise FloatingPointError(f"flagged: {kind}")

    class Log:
        def write(self, message):
            raise FloatingPointError(f"logged: {message.strip()}")

    @node(output_name="y")
    def ratio(x):
        try:
            return float(np.float64(x) / np.float64(x - 1))
        except FloatingPointError as exc:
            return str(exc)

    previous, callback = np.seterr(divide="call"), np.seterrcall(flagged)
    try:
        called = ys([ratio], xs=[1, 2])
        np.seterr(divide="log")
        np.seterrcall(Log())
        return [called, ys([ratio], xs=[1, 2])]
    finally:
        np.seterr(**previous)
        np.seterrcall(callback)


@pattern
def logging_disabled_by_the_script():
    # `logging.disable(INFO)` to quiet a run: a node that asks whether INFO is on does less
    import logging

    log = logging.getLogger("features")

    @node(output_name="y")
    def features(x):
        return {"x": x, "stats": log.isEnabledFor(logging.INFO), "warn": log.isEnabledFor(logging.WARNING)}

    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.INFO)
    try:
        logging.disable(logging.INFO)
        quiet = ys([features], xs=[1, 2])
        logging.disable(logging.NOTSET)
        return [quiet, ys([features], xs=[1, 2])]
    finally:
        logging.disable(logging.NOTSET)
        root.setLevel(level)


@pattern
def numpy_print_options_set_by_the_script():
    # a node that writes arrays as text (a report, a prompt) writes them as np.set_printoptions says
    import numpy as np

    @node(output_name="y")
    def shown(x):
        return [str(np.array([1 / 3, 2e-9]) * x), repr(np.arange(2000) * x)[-40:]]

    before = ys([shown], xs=[1, 2])
    previous = np.get_printoptions()
    np.set_printoptions(precision=3, suppress=True, threshold=50)
    try:
        return [before, ys([shown], xs=[1, 2])]
    finally:
        np.set_printoptions(**previous)


@pattern
def warning_filter_on_a_category_of_a_folder_added_at_run_time():
    # the category's module is found only through a folder the script adds to sys.path: the filter
    # travels by the category's name, and a worker that has not loaded that module leaves it out
    write("late_plugins/plugwarn.py", """
        class PlugWarning(UserWarning):
            pass
    """)
    import warnings

    @node(output_name="y")
    def plus(x):
        return x + 1

    first = ys([plus], xs=[5, 7, 11, 13])
    sys.path.append(os.path.abspath("late_plugins"))
    import plugwarn
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", plugwarn.PlugWarning)
        later = ys([plus], xs=[5, 7, 11, 13])
        once = Pipeline(nodes=[plus], engine=engine).run(inputs={"x": 100})
        return [first, later, once, ys([plus], xs=[5, 7, 11, 13])]


@pattern
def settings_changed_back_and_forth_between_calls():
    import decimal

    import numpy as np

    @node(output_name="y")
    def strict(x):
        out = []
        try:
            out.append(str(np.float64(x) / np.float64(0)))
        except FloatingPointError:
            out.append("divide raised")
        try:
            out.append(str(np.float64(1e308) * np.float64(10 * x)))
        except FloatingPointError:
            out.append("over raised")
        try:
            out.append(str(decimal.Decimal(x) / 0))
        except decimal.DivisionByZero:
            out.append("decimal raised")
        out.append(len(str(10 ** 5000)))
        return out

    answers = []
    previous, digits = np.geterr(), sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        for _ in range(3):
            np.seterr(divide="ignore")
            np.seterr(divide="raise", over="raise")
            decimal.getcontext().traps[decimal.DivisionByZero] = False
            answers.append(ys([strict], xs=[1]))
            np.seterr(divide="raise", over="ignore")
            decimal.getcontext().traps[decimal.DivisionByZero] = True
            answers.append(ys([strict], xs=[1]))
        return answers
    finally:
        np.seterr(**previous)
        decimal.setcontext(decimal.Context())
        sys.set_int_max_str_digits(digits)


@pattern
def warnings_recorded_around_a_map():
    # catch_warnings(record=True), as pytest.warns does: a worker's warnings are warned again here
    import warnings

    @node(output_name="y")
    def noisy(x):
        warnings.warn(f"item {x} is odd" if x % 2 else f"item {x} is even", RuntimeWarning, stacklevel=1)
        return x

    @node(output_name="y")
    def deprecated(x):
        warnings.warn("old API", DeprecationWarning, stacklevel=1)  # Python shows these for __main__ only
        return x

    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        ys([noisy], xs=[1, 2, 3])
    with warnings.catch_warnings(record=True) as by_module:  # filters that name the module
        warnings.simplefilter("ignore")
        warnings.filterwarnings("always", module="__main__")
        ys([deprecated], xs=[1, 2])
    with warnings.catch_warnings(record=True) as default:
        warnings.resetwarnings()
        warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")
        ys([deprecated], xs=[1, 2])
    return [sorted((str(w.message), w.category.__name__, os.path.basename(w.filename)) for w in found)
            for found in (got, by_module, default)]


corpus.close()
