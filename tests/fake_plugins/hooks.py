from rollgen import Backend, GenerationConfig, hookimpl


@hookimpl
def rollgen_register_backends(register):
    register(Backend("hooks-a", "x:Y", GenerationConfig, frozenset()))
    register(Backend("hooks-b", "x:Y", GenerationConfig, frozenset()))


# Both hooks answer whatever backend they are asked about: the registry must ask them only about
# their own two.
@hookimpl
def rollgen_conformance_config(backend, base):
    return {"asked_for": backend, "base_keys": sorted(base)}


@hookimpl
def rollgen_conformance_known_failures(backend):
    return {"test_empty_batch": f"claimed broken on {backend}"}
