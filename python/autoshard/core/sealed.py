"""Plans are built, then sealed: what parallelize, the dry run, the checkpoints and the ranks'
agreement read is what the planner decided and nothing wrote later. A plan that should differ
is made again (autoshard.plan with overrides), or read from an edited JSON document.

Every field of a plan's part is declared on its dataclass; sealing freezes the part's
attributes and turns its lists and dicts into read-only ones that compare equal to them.
Fields marked NOT_IN_DOCUMENT (what the plan was traced and made from) stay out of its JSON
document and out of its equality.

Here, below the planner, because the records a construct adds to a plan are declared in the
construct's own module (constructs/ may not import planner/)."""

import copy
from dataclasses import fields, is_dataclass

# A field's metadata: kept on the plan, left out of its JSON document (plan_json.py).
NOT_IN_DOCUMENT = {"document": False}


def in_document(field_) -> bool:
    return field_.metadata.get("document", True)


class Sealed:
    """A part of a plan whose attributes cannot be set once `_seal` has run."""

    def __setattr__(self, name: str, value) -> None:
        if self.__dict__.get("_sealed"):
            raise AttributeError(f"{type(self).__name__}.{name}: a plan cannot be changed once it is built; make "
                                 "another with autoshard.plan (overrides= keeps layers whole or gathered), or read "
                                 "an edited document with ShardingPlan.from_json")
        object.__setattr__(self, name, value)

    def _seal(self) -> None:
        if is_dataclass(self):
            for field_ in fields(self):
                value = getattr(self, field_.name)
                if type(value) is list:
                    object.__setattr__(self, field_.name, SealedList(value))
                elif type(value) is dict:
                    object.__setattr__(self, field_.name, SealedDict(value))
        object.__setattr__(self, "_sealed", True)


def _refuse(self, *args, **kwargs):
    raise AttributeError("a plan's lists and mappings cannot be changed once it is built; make another with autoshard.plan, or "
                         "read an edited document with ShardingPlan.from_json")


class SealedList(list):
    """A sealed plan's list: equal to (and read as) the list it was, with no way to change it."""

    append = extend = insert = pop = remove = clear = sort = reverse = _refuse
    __setitem__ = __delitem__ = __iadd__ = __imul__ = _refuse
    __reduce_ex__ = lambda self, protocol: (SealedList, (list(self),))
    __deepcopy__ = lambda self, memo: SealedList(copy.deepcopy(list(self), memo))


class SealedDict(dict):
    """A sealed plan's mapping: equal to (and read as) the dict it was, with no way to change it."""

    update = setdefault = pop = popitem = clear = _refuse
    __setitem__ = __delitem__ = __ior__ = _refuse
    __reduce_ex__ = lambda self, protocol: (SealedDict, (dict(self),))
    __deepcopy__ = lambda self, memo: SealedDict(copy.deepcopy(dict(self), memo))
