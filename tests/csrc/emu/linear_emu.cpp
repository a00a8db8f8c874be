// The gemv binding built with the CPU emulation of the device runtime (-DDS_EMU).
#include "ops/linear.cu"
