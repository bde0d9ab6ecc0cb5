/* Run by tests/kernels/test_cpu_arm.py under qemu-aarch64: the few-row kernel's generic body
 * (fp32 activations over bf16 weights) against a double-precision reference, every row count
 * 1-8, and each row's bits alone against the same row in the batch. */
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
int few_rows_linear_f32(const float*, float*, const float*, float, const float*, const uint16_t*, const float*, float*, int64_t, int64_t, int64_t, int64_t, int64_t);
static uint16_t to_bf16(float f){uint32_t b; memcpy(&b,&f,4); b += 0x7FFF + ((b>>16)&1); return b>>16;}
static float from_bf16(uint16_t x){uint32_t b=(uint32_t)x<<16; float f; memcpy(&f,&b,4); return f;}
int main(void){
  int N=37,K=101,R=8; srand(1);
  uint16_t *w=malloc(N*K*2); float *x=malloc(R*K*4), *out=malloc(R*N*4), *one=malloc(N*4), *bias=malloc(N*4);
  for(int i=0;i<N*K;i++) w[i]=to_bf16((rand()/(float)RAND_MAX-0.5f));
  for(int i=0;i<R*K;i++) x[i]=rand()/(float)RAND_MAX-0.5f;
  for(int i=0;i<N;i++) bias[i]=rand()/(float)RAND_MAX;
  int bad=0;
  for(int rows=1;rows<=R;rows++){
    few_rows_linear_f32(NULL,NULL,NULL,0,x,w,bias,out,rows,N,K,0,2);
    for(int m=0;m<rows;m++) for(int n=0;n<N;n++){
      double ref=bias[n]; for(int k=0;k<K;k++) ref+=(double)from_bf16(w[n*K+k])*x[m*K+k];
      if(fabs(ref-out[m*N+n])>1e-4) bad++;
      few_rows_linear_f32(NULL,NULL,NULL,0,x+m*K,w,bias,one,1,N,K,0,2);
      if(memcmp(one+n,out+m*N+n,4)) bad++;
    }
  }
  printf("aarch64 generic few_rows_linear_f32: %s (%d mismatches)\n", bad?"FAIL":"ok", bad);
  return bad!=0;
}
