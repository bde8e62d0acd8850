#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
static int cmp(const void*a,const void*b){double x=*(double*)a,y=*(double*)b;return x<y?-1:x>y;}
int main(int argc,char**argv){
  MPI_Init(&argc,&argv); int r,p; MPI_Comm_rank(MPI_COMM_WORLD,&r); MPI_Comm_size(MPI_COMM_WORLD,&p);
  long sizes[]={65536,1<<20,16<<20,64<<20}; int reps[]={200,50,8,4};
  for(int si=0;si<4;si++){
    long N=sizes[si]/4/p*p; long n=N/p;
    float*s=malloc(N*4),*rv=malloc(n*4),*st=malloc((p-1)*n*4);
    for(long i=0;i<N;i++) s[i]=(float)(i%97)*0.5f+r;
    int R=reps[si]; double t[3][200];
    for(int k=0;k<R;k++){
      for(int m=0;m<3;m++){
        MPI_Barrier(MPI_COMM_WORLD); double t0=MPI_Wtime();
        if(m==0) MPI_Reduce_scatter_block(s,rv,n,MPI_FLOAT,MPI_SUM,MPI_COMM_WORLD);
        else if(m==1){MPI_Request q; MPI_Ireduce_scatter_block(s,rv,n,MPI_FLOAT,MPI_SUM,MPI_COMM_WORLD,&q); int f=0; while(!f) MPI_Test(&q,&f,MPI_STATUS_IGNORE);}
        else { MPI_Request q[64]; int c=0;
          for(int j=1;j<p;j++){int from=(r-j+p)%p; MPI_Irecv(st+(j-1)*n,n,MPI_FLOAT,from,7,MPI_COMM_WORLD,&q[c++]);}
          for(int j=1;j<p;j++){int to=(r+j)%p; MPI_Isend(s+to*n,n,MPI_FLOAT,to,7,MPI_COMM_WORLD,&q[c++]);}
          int f=0; while(!f) MPI_Testall(c,q,&f,MPI_STATUSES_IGNORE);
          memcpy(rv,s+r*n,n*4);
          for(int j=0;j<p-1;j++){float*b=st+j*n; for(long i=0;i<n;i++) rv[i]+=b[i];}
        }
        double dt=MPI_Wtime()-t0, mx; MPI_Reduce(&dt,&mx,1,MPI_DOUBLE,MPI_MAX,0,MPI_COMM_WORLD); t[m][k]=mx;
      }
    }
    if(r==0){printf("np %d %8ld B:",p,sizes[si]); const char*nm[]={"blocking","nonblock","direct"}; for(int m=0;m<3;m++){qsort(t[m],R,8,cmp); printf("  %s %.3f ms",nm[m],t[m][R/2]*1e3);} printf("\n");}
    free(s);free(rv);free(st);
  }
  MPI_Finalize();
}
