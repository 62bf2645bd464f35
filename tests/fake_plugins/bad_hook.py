from rollgen import hookimpl


@hookimpl
def rollgen_no_such_hook():
    return None
