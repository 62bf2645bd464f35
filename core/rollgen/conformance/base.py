"""``BackendConformance``: the whole contract as pytest tests, composed of one class per area.
Subclass it to give a backend custom fixtures (override ``backend_name``, ``base_config``,
``engine`` (the engine most tests share) or ``make_engine`` (engines one test makes, shut down
when it ends); class-scoped fixtures are classmethods). At most two engines are alive at once
(the shared one and a test's own), or one with ``--rollgen-one-engine``."""

from __future__ import annotations

from rollgen.conformance.fixtures import ConformanceFixtures
from rollgen.conformance.fleet import FleetTests
from rollgen.conformance.lifecycle import BadInputTests, LifecycleTests
from rollgen.conformance.output import OutputContractTests
from rollgen.conformance.refit import RefitTests
from rollgen.conformance.sampling import OwnEngineSamplingTests, SamplingTests
from rollgen.conformance.sleep_wake import SleepWakeTests
from rollgen.conformance.streaming import StreamingTests


class BackendConformance(
    # pytest runs the tests of the LAST base first (it collects base classes in reverse MRO
    # order): bottom to top, the tests on the shared engine, then those that make their own, so
    # the shared engine is not remade for a test after them (with --rollgen-one-engine).
    LifecycleTests,
    OwnEngineSamplingTests,
    BadInputTests,
    SleepWakeTests,
    FleetTests,
    StreamingTests,
    RefitTests,
    SamplingTests,
    OutputContractTests,
    ConformanceFixtures,
):
    """The contract. Set ``backend_name`` in a subclass, or pass ``--rollgen-backend``."""
