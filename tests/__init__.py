"""memvisor's tests, a package so that tests/ and tests/live/ share their helpers through `tests.` imports."""
