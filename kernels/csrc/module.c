/* A valid (empty) Python extension module, so setuptools builds and installs lynx_codec.c as
 * `lynx_kernels._ckernels`. Nothing imports it: lynx_kernels.ops_cpu loads the shared object
 * through ctypes (which releases the GIL during each call). */
#include <Python.h>

static struct PyModuleDef ckernels = {
    PyModuleDef_HEAD_INIT, "_ckernels",
    "The lynx_kernels C codec; call it through lynx_kernels.ops_cpu (ctypes).", -1, NULL,
    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__ckernels(void) { return PyModule_Create(&ckernels); }
