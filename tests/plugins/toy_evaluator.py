"""A toy evaluator kind, registered at import."""
from retrofit.eval.evaluators import Evaluator, register_evaluator

NAME = "toy-plugin-eval"


def run(model, **kwargs):
    return {"kind": NAME}


register_evaluator(Evaluator(
    name=NAME, command=NAME, subdir="toy", heading="Toy", help="registry test entry",
    add_arguments=lambda parser, prefix: None, kwargs=lambda args: {}, run=f"{__name__}:run", order=1000,
))
