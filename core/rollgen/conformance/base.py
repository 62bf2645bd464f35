"""``BackendConformance``: the whole contract as pytest tests, composed of one class per area.
Subclass it to give a backend custom fixtures (override ``backend_name``, ``base_config``,
``engine`` (the engine most tests share) or ``make_engine`` (engines one test makes, shut down
when it ends); class-scoped fixtures are classmethods). At most two engines are alive at once
(the shared one and a test's own, or the adapter tests' engine), or one with
``--rollgen-one-engine``."""

from __future__ import annotations

from typing import ClassVar

from rollgen.conformance.adapters import AdapterTests
from rollgen.conformance.fixtures import ConformanceFixtures
from rollgen.conformance.fleet import FleetTests
from rollgen.conformance.lifecycle import BadInputTests, LifecycleTests
from rollgen.conformance.output import OutputContractTests
from rollgen.conformance.refit import RefitTests
from rollgen.conformance.sampling import OwnEngineSamplingTests, SamplingTests
from rollgen.conformance.sleep_wake import SleepWakeTests
from rollgen.conformance.streaming import StreamingTests

#: The areas in the order their tests run (the plugin sorts the collected tests by it; within an
#: area, in the order they are defined): first the tests on the shared engine, then those that
#: make their own, so the shared engine is not remade for a test after them (with
#: --rollgen-one-engine). An area of tests is a base of ``BackendConformance`` and listed here.
AREAS: tuple[type, ...] = (
    OutputContractTests,
    SamplingTests,
    RefitTests,
    StreamingTests,
    FleetTests,
    SleepWakeTests,
    BadInputTests,
    AdapterTests,
    OwnEngineSamplingTests,
    LifecycleTests,
)


class BackendConformance(*AREAS, ConformanceFixtures):  # type: ignore[misc]  # the bases: AREAS
    """The contract. Set ``backend_name`` in a subclass, or pass ``--rollgen-backend``."""

    #: The run order of the areas (a subclass may list its own areas of tests).
    areas: ClassVar[tuple[type, ...]] = AREAS
