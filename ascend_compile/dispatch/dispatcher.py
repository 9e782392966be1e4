"""The direct dispatcher of a compiled step (`ascend_compile.compile(..., dispatch="direct")`).

Each layout of call arguments goes through dynamo once (with the probe of `lowering/served.py` set);
a route is armed from that call (`route.arm`), and later calls of the layout run the route: its
checks, then the graph. A call that fails a check goes through dynamo again (dynamo's guards then
reuse the graph or compile another) and the route is armed again from it. A layout whose call
cannot be routed (a graph break, a step with Python side effects, a return value that is not the
graph's outputs) stays on dynamo's path, logged once, until `recheck()`; so does a layout whose
routes fail their checks at their first call, or cannot be armed yet, `MAX_UNUSED_ROUTES` times in
a row (something the checks compare changes on every call), where arming again each time would
cost more than dynamo. While torch is in a state no route serves (grad mode on, a compiler stance
such as "force_eager", global module hooks: `checks.arming_refusal`), calls go through dynamo and
the routes are kept for the calls after.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any, Callable

from torch._C._dynamo.guards import GlobalStateGuard

from ..lowering import served
from ..torch_support import fast_path_refusal
from . import epoch
from .checks import arming_refusal
from .frame import LayoutKey, frame_of, layout_key
from .route import Fallback, GuardPolicy, Refused, Route, arm, read_stores

log = logging.getLogger("ascend_compile")

ThroughDynamo = Callable[[tuple, dict], Any]
MAX_UNUSED_ROUTES = 4


class DirectDispatcher:
    """Routes of one compiled step, per layout of call arguments."""

    def __init__(self, step: Any, guard_policy: GuardPolicy | None = None) -> None:
        frame = frame_of(step)
        #: direct calls are armed only on the torches that proved them (`torch_support.FAST_PATHS`)
        unproven = fast_path_refusal("direct")
        self.frame = dataclasses.replace(frame, refusal=unproven) if unproven and not frame.refusal else frame
        self.guard_policy = guard_policy  # asked of dynamo's guards before a route stands in for them
        self.routes: dict[LayoutKey, Route | str] = {}  # a str: why calls of that layout stay on dynamo's path
        self._stores: dict[LayoutKey, tuple] = {}  # constant stores to read before a layout's next dynamo call
        self._unused: dict[LayoutKey, int] = {}  # arming attempts in a row that no direct call followed
        self._lock = threading.Lock()
        self._logged: set[str] = set()
        epoch.install()
        if self.frame.refusal:
            log.info("ascend_compile: dispatch='direct': %s: calls go through dynamo", self.frame.refusal)

    def __call__(self, args: tuple, kwargs: dict, through_dynamo: ThroughDynamo) -> Any:
        key = layout_key(args, kwargs)
        route = self.routes.get(key)
        if type(route) is Route:
            try:
                return route(args, kwargs)
            except Fallback as why:
                self._log(f"ascend_compile: dispatch='direct': {why.kind}: this call goes through dynamo's guards",
                          why.detail)
                if arming_refusal() is not None:  # the route stays for later calls; this one is dynamo's
                    return self._through_dynamo(key, args, kwargs, through_dynamo)
                unused = self._unused[key] = self._unused.get(key, 0) + 1 if not route.used else 1
                if unused >= MAX_UNUSED_ROUTES:
                    self.routes[key] = f"{unused} routes in a row failed at their first call ({why.kind})"
                    self._log(f"ascend_compile: dispatch='direct': {self.routes[key]}: calls of this layout go "
                              f"through dynamo")
                    return through_dynamo(args, kwargs)
        elif route is not None or self.frame.refusal:
            return through_dynamo(args, kwargs)
        return self._through_dynamo(key, args, kwargs, through_dynamo)

    def recheck(self) -> None:
        """Send the next call of every layout through dynamo's guards (and arm its route again)."""
        with self._lock:
            self.routes.clear()
            self._stores.clear()
            self._unused.clear()

    def _through_dynamo(self, key: LayoutKey, args: tuple, kwargs: dict, through_dynamo: ThroughDynamo) -> Any:
        refusal = arming_refusal()
        if refusal is not None:
            self._log(f"ascend_compile: dispatch='direct': {refusal}: calls go through dynamo meanwhile")
            return through_dynamo(args, kwargs)
        stores = self._stores.pop(key, ())
        stores_before = read_stores(self.frame, key, stores, args, kwargs) if stores else None
        before = GlobalStateGuard()
        with served.probe() as calls:
            result = through_dynamo(args, kwargs)
        with self._lock:
            try:
                if not before.check():
                    raise Refused(f"the call changed torch's global state ({before.reason()})", permanent=False)
                self.routes[key] = arm(self.frame, key, calls, args, kwargs, result, stores_before,
                                      self.guard_policy)
                self._log(f"ascend_compile: dispatch='direct': calls of {self.frame.func.__qualname__} go "
                          f"straight to their graph")
            except Refused as refused:
                self.routes.pop(key, None)
                if refused.stores:
                    self._stores[key] = refused.stores
                unarmed = self._unused[key] = self._unused.get(key, 0) + 1
                if refused.permanent or unarmed >= MAX_UNUSED_ROUTES:
                    self.routes[key] = str(refused)
                    self._log(f"ascend_compile: dispatch='direct': {refused}: calls of this layout go through dynamo")
                else:
                    log.debug("ascend_compile: dispatch='direct': not armed yet: %s", refused)
        return result

    def _log(self, message: str, detail: str = "") -> None:
        """INFO the first time, DEBUG after."""
        first = message not in self._logged
        self._logged.add(message)
        log.log(logging.INFO if first else logging.DEBUG, "%s%s", message, f" ({detail})" if detail else "")
