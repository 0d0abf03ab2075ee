#define _POSIX_C_SOURCE 200809L
#include <time.h>
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#define S 32
#define L 192
#define KVH 12
#define RB 256  /* bytes per head row */
#define PAGE 16
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc,char**argv){
  int mode=atoi(argv[1]); int dist=atoi(argv[2]);
  int64_t slots=S*L+4096; size_t bytes=(size_t)slots*KVH*RB;
  char*k=aligned_alloc(64,bytes); char*v=aligned_alloc(64,bytes); memset(k,1,bytes); memset(v,1,bytes);
  int64_t npages=slots/PAGE; int64_t*perm=malloc(sizeof(int64_t)*npages);
  for(int64_t i=0;i<npages;i++)perm[i]=i;
  srand(1); for(int64_t i=npages-1;i>0;i--){int64_t j=rand()%(i+1);int64_t t=perm[i];perm[i]=perm[j];perm[j]=t;}
  int64_t*slot=malloc(sizeof(int64_t)*S*L);
  for(int s=0;s<S;s++)for(int j=0;j<L;j++)slot[s*L+j]=perm[s*(L/PAGE)+j/PAGE]*PAGE+j%PAGE;
  char*flush=malloc(64<<20);
  double best=1e9; float sink=0;
  for(int it=0;it<20;it++){
    memset(flush,it,64<<20);
    double t0=now();
    float tot=0;
    if(mode==0){ /* item = (seq, head): strided rows */
#pragma omp parallel for collapse(2) schedule(dynamic,4) reduction(+:tot)
      for(int s=0;s<S;s++)for(int h=0;h<KVH;h++){
        __m512 a=_mm512_setzero_ps();
        const int64_t*sl=slot+s*L;
        for(int j=0;j<L;j++){
          if(dist&&j+dist<L){const char*p=k+(sl[j+dist]*KVH+h)*RB;for(int b=0;b<RB;b+=64)__builtin_prefetch(p+b);}
          const char*p=k+(sl[j]*KVH+h)*RB;
          for(int b=0;b<RB;b+=64)a=_mm512_add_ps(a,_mm512_load_ps((const float*)(p+b)));
        }
        for(int j=0;j<L;j++){
          const char*p=v+(sl[j]*KVH+h)*RB;
          for(int b=0;b<RB;b+=64)a=_mm512_add_ps(a,_mm512_load_ps((const float*)(p+b)));
        }
        tot+=_mm512_reduce_add_ps(a);
      }
    } else { /* item = seq: contiguous all-head rows */
#pragma omp parallel for schedule(dynamic,1) reduction(+:tot)
      for(int s=0;s<S;s++){
        __m512 a=_mm512_setzero_ps();
        const int64_t*sl=slot+s*L;
        for(int j=0;j<L;j++){
          if(dist&&j+dist<L){const char*p=k+(sl[j+dist]*KVH)*RB;for(int b=0;b<RB*KVH;b+=64)__builtin_prefetch(p+b);}
          const char*p=k+(sl[j]*KVH)*RB;
          for(int b=0;b<RB*KVH;b+=64)a=_mm512_add_ps(a,_mm512_load_ps((const float*)(p+b)));
        }
        for(int j=0;j<L;j++){
          const char*p=v+(sl[j]*KVH)*RB;
          for(int b=0;b<RB*KVH;b+=64)a=_mm512_add_ps(a,_mm512_load_ps((const float*)(p+b)));
        }
        tot+=_mm512_reduce_add_ps(a);
      }
    }
    double dt=now()-t0; if(dt<best)best=dt; sink+=tot;
  }
  double mb=2.0*S*L*KVH*RB/1e6;
  printf("mode %d dist %d: %.0f us, %.1f GB/s (%g)\n",mode,dist,best*1e6,mb/1e3/best,sink>0?0.0:1.0);
}
