"""te_lab's magics: %te_fuse, %te_unfuse, %te_profile / %%te_profile, %te_opportunities, %te_status.

They parse arguments, call te_lab's public API and display the result; nothing else.
A user's mistake (an unknown name, an expression that fails, a non-Module, a bad
option or rule name, a missing device) raises ``UsageError`` with one sentence; an
error inside the user's own statement under ``%te_profile`` propagates unchanged.
"""

from __future__ import annotations

import argparse
import ast

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class, no_var_expand
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from IPython.display import display
from IPython.utils.process import arg_split
from torch import nn

from te_lab.options import BACKEND_CHOICES, KEEP_CHOICES, argument_type, check_budget, check_steps, check_warmup
from te_lab.profiler import ProfileRun, profile_generation
from te_lab.profiler.engine import OPPORTUNITY_STEPS
from te_lab.profiler.opportunities import opportunities
from te_lab.status import status_lines
from te_lab.surgery import fuse, fusions, is_fused, unfuse
from te_lab.views import show, to_html


def _statement_text(line: str, statement: list[str]) -> str:
    """The statement as typed: the rest of the line from its first token on (re-joining
    the split tokens would change spacing inside string literals)."""
    if not statement:
        return ""
    position = 0
    for token in arg_split(line, strict=False):
        if token == statement[0]:
            break
        position = line.index(token, position) + len(token)
    return line[line.index(statement[0], position):]


def _names(value):
    return None if value is None else [part.strip() for part in value.split(",") if part.strip()]


@magics_class
class TeLabMagics(Magics):
    def _evaluate(self, expression: str, what: str):
        try:
            return self.shell.ev(expression)
        except Exception as error:  # noqa: BLE001 - the user's expression; one clear sentence
            raise UsageError(f"{what} {expression!r} could not be evaluated: {type(error).__name__}: {error}") from None

    def _model(self, expression: str, magic: str) -> nn.Module:
        model = self._evaluate(expression, f"{magic}: MODEL")
        if not isinstance(model, nn.Module):
            raise UsageError(f"{magic}: MODEL {expression!r} is a {type(model).__name__}, not a torch.nn.Module")
        return model

    @magic_arguments()
    @argument("model", help="the model, an expression in your namespace (nets['big'], self.net, ...)")
    @argument("--only", help="comma-separated rule names or module-path globs to fuse (see te_lab.rules())")
    @argument("--exclude", help="comma-separated rule names or module-path globs to leave alone")
    @argument("--backend", default="auto", choices=BACKEND_CHOICES, help="backend forced on every fused op")
    @argument("--sample", help="inputs for the model, an expression: a tensor, a tuple, or a dict of kwargs")
    @argument("--no-verify", action="store_true", help="swap without probing each module (not recommended)")
    @argument("--keep", default="faster", choices=KEEP_CHOICES,
              help="faster (default): twins step aside at sizes where the original measures faster; all: every "
                   "verified twin runs fused")
    @argument("--regions", help="comma-separated module paths, globs or class names no rule knows, to compile alone "
                                "(torch.compile), verify and keep where faster (needs --sample)")
    @argument("--regions-of", metavar="EXPR",
              help="an expression giving the regions: rows of te_lab.opportunities, or its whole result")
    @argument("--auto", action="store_true", help="time each twin and keep only those faster on this device")
    @argument("--dry-run", action="store_true", help="probe the candidates but swap nothing")
    @argument("-o", dest="output", action="store_true",
              help="return the FusionReport (report = %%te_fuse model -o), as %%timeit -o does")
    @argument("-q", dest="quiet", action="store_true", help="display nothing")
    @no_var_expand
    @line_magic
    def te_fuse(self, line):
        """Swap MODEL's layers for fused kernels in place, each swap probe-verified.

        Example::

            report = %te_fuse model --sample batch -o
            %te_fuse nets["big"] --exclude lm_head_loss,model.layers.0.* --auto
        """
        args = parse_argstring(self.te_fuse, line)
        model = self._model(args.model, "%te_fuse")
        sample = None if args.sample is None else self._evaluate(args.sample, "%te_fuse: --sample")
        if args.regions is not None and args.regions_of is not None:
            raise UsageError("%te_fuse: give --regions or --regions-of, not both")
        regions = _names(args.regions) if args.regions_of is None else \
            self._evaluate(args.regions_of, "%te_fuse: --regions-of")
        try:
            report = fuse(model, sample=sample, only=_names(args.only), exclude=_names(args.exclude),
                          backend=args.backend, verify=not args.no_verify, keep=args.keep, auto=args.auto,
                          dry_run=args.dry_run, regions=regions)
        except (TypeError, ValueError, RuntimeError) as error:
            raise UsageError(f"%te_fuse: {error}") from None
        if not args.quiet:
            display(report)
        return report if args.output else None

    @magic_arguments()
    @argument("model", help="the fused model, an expression in your namespace")
    @no_var_expand
    @line_magic
    def te_unfuse(self, line):
        """Put MODEL's original modules back; says what it restored.

        Example::

            %te_unfuse model
        """
        args = parse_argstring(self.te_unfuse, line)
        print(unfuse(self._model(args.model, "%te_unfuse")))

    @magic_arguments()
    @argument("--model", help="the fused model to switch (default: every fused model in the namespace)")
    @argument("--steps", type=argument_type(check_steps), default="auto",
              help="timed steps per mode, or auto: interleaved pairs until the speedup's 95%% interval is within "
                   "±3%% or --budget runs out (default auto)")
    @argument("--budget", type=argument_type(check_budget), default=60.0, metavar="SECONDS",
              help="with --steps auto, the most seconds spent on timed steps (default 60)")
    @argument("--warmup", type=argument_type(check_warmup), default=2, help="untimed steps per mode first (default 2)")
    @argument("--no-backward", action="store_true", help="do not differentiate the statement's value")
    @argument("--generation", action="store_true",
              help="the statement generates (model.generate(...)): profile prefill and decode apart, eager against "
                   "fused (te_lab.profile_generation; --steps N: N timed runs per mode, auto: 3)")
    @argument("--html", metavar="PATH", help="also write the static report to PATH (.html)")
    @argument("--no-opportunities", action="store_true",
              help="skip the fusion-opportunity finder's steps (the dashboard's Opportunities tab is then empty)")
    @argument("-o", dest="output", action="store_true",
              help="return the ProfileReport (report = %%te_profile -o ...), as %%timeit -o does")
    @argument("statement", nargs=argparse.REMAINDER, help="the code to profile (the line form)")
    @no_var_expand
    @line_cell_magic
    def te_profile(self, line, cell=None):
        """Run STATEMENT with fusion off and on, profile both, and show the dashboard.

        A statement that is an expression (``model(**batch)``) has its value's loss
        differentiated, as te_lab.profile does; other code runs as it is (put your own
        ``.backward()`` in it). The cell form profiles the whole cell. The code runs
        many times (warm-up, timed and profiled steps, in both modes: with ``--steps
        auto``, until the speedup's interval is within ±3% or ``--budget`` seconds are
        spent), and the magic prints how many; code that changes the parameters (an
        optimizer step) gets a warning, as the figures then measure a moving model.

        Example::

            %te_profile --model model model(**batch)
            %%te_profile --steps 3 --html report.html
            loss = model(**batch).loss
            loss.backward()
        """
        args = parse_argstring(self.te_profile, line)
        if cell is not None:
            if args.statement:
                raise UsageError("%%te_profile: the code goes in the cell body, not on the magic's line")
            report = self._profile(args, cell, "cell")
        else:
            report = self._profile(args, _statement_text(line, args.statement), "statement")
        return report if args.output else None

    def _fused_in_namespace(self) -> dict:
        return {name: value for name, value in self.shell.user_ns.items()
                if not name.startswith("_") and isinstance(value, nn.Module) and is_fused(value)}

    def _fused_models(self, expression) -> dict:
        if expression is not None:
            model = self._model(expression, "%te_profile: --model")
            if not is_fused(model):
                raise UsageError(f"%te_profile: --model {expression!r} has no te_lab fusions; run %te_fuse first")
            return {expression: model}
        found = self._fused_in_namespace()
        if not found:
            raise UsageError("%te_profile: no fused model in the namespace; run %te_fuse MODEL first or pass --model")
        return found

    def _profile(self, args, code: str, what: str):
        if not code.strip():
            raise UsageError("%te_profile: give the statement to profile")
        if args.html is not None and not args.html.lower().endswith((".html", ".htm")):
            raise UsageError(f"%te_profile: --html must name an .html file, got {args.html!r}")
        models = self._fused_models(args.model)
        if args.generation and args.html:
            raise UsageError("%te_profile --generation: --html is for the training-step dashboard; the generation "
                             "profile is shown as a table (return it with -o)")
        if args.generation and len(models) != 1:
            raise UsageError(f"%te_profile --generation: profiles one fused model; found {', '.join(models)}: "
                             f"pass --model")
        code = self.shell.transform_cell(code)  # IPython syntax (%magics, !commands) as in a cell
        try:
            tree = ast.parse(code, mode="eval")
            compiled, is_expression = compile(tree, "<te_profile>", "eval"), True
        except SyntaxError:
            try:
                compiled, is_expression = compile(code, "<te_profile>", "exec"), False
            except SyntaxError as error:
                raise UsageError(f"%te_profile: the statement is not valid Python: {error}") from None
        namespace = self.shell.user_ns
        runs = 0

        def run():
            nonlocal runs
            runs += 1
            if is_expression:
                return eval(compiled, namespace)
            exec(compiled, namespace)
            return None

        if args.generation:
            profile = profile_generation(run, next(iter(models.values())),
                                                runs=3 if args.steps == "auto" else args.steps)
            print(f"%te_profile: ran the {what} {runs} times (a warm-up, a profiled and {profile.runs} timed runs in "
                  f"each of eager and fused mode)")
            show(profile)
            return profile
        profile_run = ProfileRun.statement(run, models, steps=args.steps, warmup=args.warmup, budget_s=args.budget,
                                           backward=is_expression and not args.no_backward,
                                           opportunities=not args.no_opportunities)
        report = None
        try:
            report = profile_run.run()
        finally:
            steps = args.steps if report is None else len(report.modes["eager"].step_ms)
            print(f"%te_profile: ran the {what} {runs} times ({args.warmup} warm-up and {steps} timed steps, "
                  f"then profiled steps (and on the CPU as many clocked ones), in each of eager and fused mode"
                  + ("" if args.no_opportunities else f", then {1 + 2 * OPPORTUNITY_STEPS} per mode for the "
                     f"opportunity finder") + ")")
        if args.html:
            print(f"static report written to {to_html(report, args.html)}")
        show(report, rerun=profile_run)
        return report

    @magic_arguments()
    @argument("model", help="the model, an expression in your namespace")
    @argument("--sample", required=True, help="inputs for the model, an expression: a tensor, a tuple, or a dict")
    @argument("--mode", choices=("eager", "fused"),
              help="fused (default for a fused model: what fusion left) or eager (default otherwise)")
    @argument("--top", type=int, default=10, help="rows shown (default 10)")
    @argument("--no-backward", action="store_true", help="look at the forward only")
    @argument("--against", metavar="EXPR",
              help="an earlier result on this model: its rows' modules are clocked too, and its rows are shown "
                   "with the gains realized since")
    @argument("-o", dest="output", action="store_true",
              help="return the result (found = %%te_opportunities model --sample batch -o)")
    @argument("-q", dest="quiet", action="store_true", help="display nothing")
    @no_var_expand
    @line_magic
    def te_opportunities(self, line):
        """Rank MODEL's unfused chains of memory-bound ops by the gain a fused kernel would
        estimate, per module and op pattern, with what te_lab rule would fuse each.

        Example::

            found = %te_opportunities model --sample batch -o
            %te_fuse model --sample batch --regions-of found.top(2)
            %te_opportunities model --sample batch --against found
        """
        args = parse_argstring(self.te_opportunities, line)
        model = self._model(args.model, "%te_opportunities")
        sample = self._evaluate(args.sample, "%te_opportunities: --sample")
        against = None if args.against is None else self._evaluate(args.against, "%te_opportunities: --against")
        if args.top < 1:
            raise UsageError(f"%te_opportunities: --top must be a positive integer, got {args.top}")
        try:
            found = opportunities(model, sample, backward=not args.no_backward, mode=args.mode, against=against)
        except (TypeError, ValueError, RuntimeError) as error:
            raise UsageError(f"%te_opportunities: {error}") from None
        if not args.quiet:
            print(found.summary(args.top))
            if against is not None:
                print(against.realized(found).summary(args.top))
        return found if args.output else None

    @line_magic
    def te_status(self, line):
        """Devices, backends per op, versions, and the fused models in the namespace.

        Example::

            %te_status
        """
        if line.strip():
            raise UsageError(f"%te_status takes no arguments, got {line.strip()!r}")
        lines = status_lines()
        lines.append("fused models: " + (", ".join(f"{name} ({len(fusions(value))} fused modules)"
                                                   for name, value in self._fused_in_namespace().items()) or "none"))
        print("\n".join(lines))
