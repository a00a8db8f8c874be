// The gemv bindings built with the CPU emulation of the device runtime (-DDS_EMU): the plain
// projection and the ones that make their input in a prologue.
#include "ops/linear.cu"
#include "ops/linear_prologue.cu"
