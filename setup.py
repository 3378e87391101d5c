# The C extension (native/) is built by cffi during every install; a missing
# compiler or header fails the install with the compiler's message.
from setuptools import setup

setup(cffi_modules=["native/build_native.py:ffibuilder"])
